"""Rewards that run the response's code in the sandbox (``workers.sandbox``), and their helpers.

``code_exec``: the response's program against the sample's ground truth.

- The program is the response's last fenced ```python (or ```py) block,
  an unterminated one included (a response cut by max_new_tokens); without
  one, the whole response (``extract_code``).
- A ground truth that is a list of test cases, as JSON text or a list,
  ``[{"stdin": "1 2\\n", "expected": "3"}, ...]``: the fraction of cases whose
  run ends "ok" with stdout equal to ``expected``, both stripped
  (``test_cases``). Each case is its own sandbox, ``max_workers`` at once.
- Any other ground truth is the expected stdout: 1.0 if the program, run
  without stdin, ends "ok" and prints it (stripped), else 0.0.

``code_expression``: the response is a Python expression (the longest
prefix of its code's first line that parses as one expression, so trailing
text is ignored: ``expression_of``); the sandbox runs
``print((<expression>))`` and the score is 1.0 when the printed value is the
ground truth (as numbers when both are numbers, ``12.0`` equals ``12``; else
as stripped text), else 0.0. A response with no expression scores 0.0
without running anything.

``code_expression_shaped``: ``code_expression`` with partial credit that a
random policy can climb: a printed number ``v`` that is not the target ``t``
scores ``0.5 * max(0, 1 - |v - t| / max(1, |t|))``.

Keyword arguments (``reward.kwargs``): ``timeout`` (seconds per run;
default 5 for the expression rewards, the sandbox's 10 for ``code_exec``),
``memory`` (bytes), and for ``code_exec`` ``max_workers`` (4).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from workers.sandbox import SandboxLimits, run, run_many

__all__ = ["code_exec", "code_expression", "code_expression_shaped", "expression_of", "extract_code",
           "same_output", "test_cases"]

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)(?:```|\Z)", re.S | re.I)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
EXPRESSION_TIMEOUT_S = 5.0


def extract_code(response: str) -> str:
    """The last fenced ```python / ```py block of ``response`` (unterminated included), else all of it."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def test_cases(ground_truth: Any) -> list[dict[str, Any]] | None:
    """``[{"stdin": str | None, "expected": str}, ...]`` when ``ground_truth`` is a list of test cases, else None.

    A case is a mapping with an ``expected`` key (and an optional ``stdin``);
    the list may come as JSON text. Anything else (a JSON list of numbers,
    say) is not a list of cases: it is an expected stdout.
    """
    value = ground_truth.tolist() if hasattr(ground_truth, "tolist") else ground_truth
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("["):
            return None
        try:
            value = json.loads(text)
        except ValueError:
            return None
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if not all(isinstance(case, Mapping) and "expected" in case for case in value):
        return None
    cases = []
    for case in value:
        stdin = case.get("stdin")
        cases.append({"stdin": None if stdin is None else str(stdin), "expected": str(case["expected"])})
    return cases


def _number(text: str) -> Decimal | None:
    """``text`` (stripped) as a number when it is written as one (``-12``, ``3.5``, ``1e3``), else None."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def same_output(printed: str, expected: str) -> bool:
    """Whether ``printed`` equals ``expected``, both stripped."""
    return printed.strip() == str(expected).strip()


def _same_value(printed: str, target: str) -> bool:
    a, b = _number(printed), _number(target)
    if a is not None and b is not None:
        return a == b
    return same_output(printed, target)


def _limits(timeout: float | None, memory: int | None, default_timeout: float | None) -> SandboxLimits:
    return SandboxLimits().replace(timeout=timeout if timeout is not None else default_timeout, memory=memory)


def _need_ground_truth(name: str, ground_truth: Any) -> None:
    if ground_truth is None:
        raise ValueError(f"{name} needs a ground truth; the batch has no 'ground_truth' field for this sample")


def code_exec(prompt: str, response: str, ground_truth: Any, extra: dict, timeout: float | None = None,
              memory: int | None = None, max_workers: int = 4, **kwargs: Any) -> float:
    """The fraction of the ground truth's test cases the response's program passes (see the module docstring)."""
    _need_ground_truth("code_exec", ground_truth)
    code = extract_code(response)
    cases = test_cases(ground_truth) or [{"stdin": None, "expected": str(ground_truth)}]
    results = run_many([{"code": code, "stdin": case["stdin"]} for case in cases], max_workers=max_workers,
                       limits=_limits(timeout, memory, None))
    passed = sum(1 for case, result in zip(cases, results)
                 if result.ok and same_output(result.stdout, case["expected"]))
    return passed / len(cases)


def expression_of(response: str) -> str | None:
    """The longest prefix of the first non-blank line of ``extract_code(response)`` that is one Python
    expression (``ast.parse(mode="eval")``), stripped; None when no prefix is."""
    lines = [line for line in extract_code(response).splitlines() if line.strip()]
    if not lines:
        return None
    line = lines[0].strip()
    for end in range(len(line), 0, -1):
        candidate = line[:end].strip()
        if not candidate:
            break
        try:
            ast.parse(candidate, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            continue
        return candidate
    return None


def _printed_expression(response: str, timeout: float | None, memory: int | None) -> str | None:
    """What the sandbox prints for the response's expression, or None (no expression, or the run failed)."""
    expression = expression_of(response)
    if expression is None:
        return None
    result = run(f"print((\n{expression}\n))", limits=_limits(timeout, memory, EXPRESSION_TIMEOUT_S))
    return result.stdout if result.ok else None


def code_expression(prompt: str, response: str, ground_truth: Any, extra: dict, timeout: float | None = None,
                    memory: int | None = None, **kwargs: Any) -> float:
    """1.0 if ``print((<the response's expression>))`` prints the ground truth in the sandbox, else 0.0."""
    _need_ground_truth("code_expression", ground_truth)
    printed = _printed_expression(response, timeout, memory)
    return 1.0 if printed is not None and _same_value(printed, str(ground_truth)) else 0.0


def code_expression_shaped(prompt: str, response: str, ground_truth: Any, extra: dict, timeout: float | None = None,
                           memory: int | None = None, **kwargs: Any) -> float:
    """``code_expression``, with partial credit for a printed number near the target (module docstring)."""
    _need_ground_truth("code_expression_shaped", ground_truth)
    target = str(ground_truth)
    printed = _printed_expression(response, timeout, memory)
    if printed is None:
        return 0.0
    if _same_value(printed, target):
        return 1.0
    value, goal = _number(printed), _number(target)
    if value is None or goal is None:
        return 0.0
    return float(Decimal("0.5") * max(Decimal(0), 1 - abs(value - goal) / max(Decimal(1), abs(goal))))
