"""The reward rules that read text only: a final numeric answer, exact-answer and format checks.

This module imports nothing but the standard library, and nothing of the project: tools/bench_e2e.py's TRL
side loads it by path in TRL's own virtual environment, without the project on its path, so that the reward
TRL optimises is this code itself (tests/test_bench_e2e.py loads it so, in a bare interpreter).
``workers.reward.functions`` re-exports each, with the rest of the built-ins.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

__all__ = ["arithmetic_answer", "arithmetic_shaped", "final_answer", "format_check"]

# A number: optional minus (not when it follows a digit, where it is a
# subtraction), digits with optional thousands commas, optional decimals.
_NUMBER = r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_MARKER = "####"
_FORMAT_RE = re.compile(r"####[ \t]*" + _NUMBER + r"\s*\Z")


def _to_decimal(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def final_answer(text: str) -> Decimal | None:
    """The final numeric answer in ``text``, or None when it has none.

    With a ``####`` marker, it is the first number after the last marker
    (None if no number follows it: the text committed to an answer that is
    not a number). Without one, it is the last number in the text. Thousands
    commas are dropped, so ``"1,000"`` and ``"1000"`` agree.
    """
    if _MARKER in text:
        match = _NUMBER_RE.search(text, text.rindex(_MARKER) + len(_MARKER))
        return _to_decimal(match.group()) if match else None
    numbers = _NUMBER_RE.findall(text)
    return _to_decimal(numbers[-1]) if numbers else None


def _ground_truth_number(fn_name: str, ground_truth: Any) -> Decimal:
    if ground_truth is None:
        raise ValueError(f"{fn_name} needs a ground truth; the batch has no 'ground_truth' field for this sample")
    answer = final_answer(str(ground_truth))
    if answer is None:
        raise ValueError(f"{fn_name}: ground truth {ground_truth!r} contains no number")
    return answer


def _answer_text(number: Decimal) -> str:
    """The number as plainly written: ``Decimal("42.0")`` -> ``"42"``, ``Decimal("1.50")`` -> ``"1.5"``."""
    text = format(number.normalize(), "f")
    return "0" if text in ("-0", "0") else text


def arithmetic_answer(prompt: str, response: str, ground_truth: str | None, extra: dict, **kwargs: Any) -> float:
    """1.0 if the response's final answer equals the ground truth's as a number, else 0.0.

    Both sides go through ``final_answer``, so a GSM8K ground truth
    ("... #### 72") and a bare one ("72") both work, and "72.0" matches "72".
    """
    expected = _ground_truth_number("arithmetic_answer", ground_truth)
    answer = final_answer(response)
    return 1.0 if answer is not None and answer == expected else 0.0


def format_check(prompt: str, response: str, ground_truth: str | None, extra: dict, **kwargs: Any) -> float:
    """1.0 if the response ends with ``#### <number>`` (trailing whitespace allowed), else 0.0."""
    return 1.0 if _FORMAT_RE.search(response) else 0.0


def arithmetic_shaped(prompt: str, response: str, ground_truth: str | None, extra: dict, **kwargs: Any) -> float:
    """``arithmetic_answer`` plus a partial score that a random policy can climb.

    A correct final answer scores 1.0. Otherwise the score is

        0.5 * min(leading_digits, len(target)) / len(target)

    where ``target`` is the ground-truth answer as plainly written ("42",
    "-3", "1.5") and ``leading_digits`` counts the characters 0-9 at the very
    start of the response (no whitespace skipped). So a wrong answer earns at
    most 0.5 and a response that does not start with a digit earns 0: first
    the policy learns to answer with a number of the right length, then the
    1.0 for the right number takes over.
    """
    expected = _ground_truth_number("arithmetic_shaped", ground_truth)
    answer = final_answer(response)
    if answer is not None and answer == expected:
        return 1.0
    target = _answer_text(expected)
    leading = len(response) - len(response.lstrip("0123456789"))
    return 0.5 * min(leading, len(target)) / len(target)
