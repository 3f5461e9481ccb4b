"""Math answer equivalence through ``math-verify``: ``\\boxed{\\frac{1}{2}}`` equals ``0.5``.

Both sides are parsed by ``math_verify.parse`` (LaTeX and plain expressions)
and compared by ``math_verify.verify`` (symbolic, then numeric), so
``2\\sqrt{2}`` matches ``\\sqrt{8}`` without any hand-written normaliser.
A bare ground truth (MATH-lighteval rows keep the boxed content, e.g.
``\\frac{1}{2}``) is boxed first, as verl does, so that LaTeX extraction
anchors on it.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

__all__ = ["math_equivalence"]


def _timeout() -> int | None:
    # math-verify times out with SIGALRM, which only the main thread may set; Ray runs actor
    # methods on other threads, where parsing runs without a time limit instead of raising.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _gold_text(ground_truth: Any) -> str:
    text = str(ground_truth).strip()
    return text if "\\boxed" in text or "$" in text else "\\boxed{" + text + "}"


@functools.lru_cache(maxsize=4096)
def _parsed_gold(text: str, timeout: int | None) -> list:
    """A ground truth parses the same for every response to its prompt, step after step: parse it once."""
    from math_verify import parse

    return parse(text, parsing_timeout=timeout)


def math_equivalence(prompt: str, response: str, ground_truth: Any, extra: dict, **kwargs: Any) -> float:
    """1.0 if the response's answer is mathematically equal to the ground truth, else 0.0.

    A list ground truth holds several accepted answers: any of them counts.
    """
    from math_verify import parse, verify

    if ground_truth is None:
        raise ValueError("math_equivalence needs a ground truth; the batch has no 'ground_truth' field for this sample")
    timeout = _timeout()
    answer = parse(response, parsing_timeout=timeout)
    if not answer:
        return 0.0
    truths = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    for truth in truths:
        gold = _parsed_gold(_gold_text(truth), timeout)
        if gold and verify(gold, answer, timeout_seconds=timeout):
            return 1.0
    return 0.0
