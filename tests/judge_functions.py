"""A generative judge's template and parser of a test's own (reward.judge.template / .parser by import path)."""

import time

SLOW_SECONDS = 4.0


def first_digit(verdict: str, row: dict) -> float | None:
    """The verdict's first digit over 9; None (unreadable) where it has none."""
    digits = [c for c in verdict if c.isdigit()]
    return int(digits[0]) / 9 if digits else None


def is_slow(question: str) -> bool:
    """The questions the slow template takes too long on: those that start with an odd digit ("3+4=")."""
    return question[:1] in "13579" and question[:1] != ""


def slow_on_odd(row: dict) -> str:
    """The user turn; on a question ``is_slow`` picks, it first sleeps past any short timeout."""
    if is_slow(row["question"]):
        time.sleep(SLOW_SECONDS)
    return f"Q: {row['question']} A: {row['response']} Verdict:"
