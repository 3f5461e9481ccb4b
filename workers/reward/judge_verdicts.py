"""A generative judge's prompt and verdict: the template that writes its user turn, the parser that reads its score.

    template = resolve_template("Question: {question}\\nAnswer: {response}\\nScore it out of 10.")
    template({"question": "2+2=", "response": "4", "reference": "4"})      # -> the judge's user turn
    parser = resolve_parser("score_out_of_10")
    parser("The answer is right. Score: 9/10", row)                       # -> 0.9; None: no verdict found

A template is a Python format string over ``{question}``, ``{response}`` and ``{reference}`` (an unknown
placeholder is refused when it is resolved, before launch), or ``"package.module:function"`` taking the row
(a dict: ``question``, ``response``, ``reference``, ``data_source`` and the row's other fields) and returning
the text. A parser is a built-in (``PARSERS``) or ``"package.module:function"`` taking (the verdict, the row)
and returning a float, or None where the verdict says nothing it can read.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable
from typing import Any

from workers.import_path import import_object

__all__ = ["DEFAULT_TEMPLATE", "PARSERS", "PLACEHOLDERS", "boxed", "resolve_parser", "resolve_template",
           "checked_score", "score_out_of_10", "template_placeholders", "yes_no"]

PLACEHOLDERS = ("question", "response", "reference")

DEFAULT_TEMPLATE = ("Grade the response to the question below for correctness and helpfulness.\n\n"
                    "Question: {question}\n\nResponse: {response}\n\n"
                    "End with your score as 'Score: N/10', N from 0 to 10.")

_NUMBER = r"(-?\d+(?:\.\d+)?)"


def score_out_of_10(verdict: str, row: dict | None = None) -> float | None:
    """The last ``N/10`` or ``N out of 10`` in the verdict (else the number after the last ``score``), over 10,
    clipped to [0, 1]."""
    found = re.findall(_NUMBER + r"\s*(?:/|out of)\s*10\b", verdict, flags=re.I)
    if not found:
        found = re.findall(r"score\s*(?:is|of|:|=)?\s*\**\s*" + _NUMBER, verdict, flags=re.I)
    if not found:
        return None
    return min(1.0, max(0.0, float(found[-1]) / 10.0))


def boxed(verdict: str, row: dict | None = None) -> float | None:
    """The number in the verdict's last ``\\boxed{...}``."""
    found = re.findall(r"\\boxed\{\s*" + _NUMBER + r"\s*\}", verdict)
    return float(found[-1]) if found else None


def yes_no(verdict: str, row: dict | None = None) -> float | None:
    """1.0 for a last word "yes", 0.0 for "no" (the last of the two the verdict says, whole words, any case)."""
    found = re.findall(r"\b(yes|no)\b", verdict, flags=re.I)
    return None if not found else float(found[-1].lower() == "yes")


PARSERS: dict[str, Callable[[str, dict | None], float | None]] = {
    "score_out_of_10": score_out_of_10, "boxed": boxed, "yes_no": yes_no}


def template_placeholders(template: str) -> list[str]:
    """The placeholders a format-string template names (ValueError for a malformed one)."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def resolve_template(template: str | Callable, key: str = "reward.judge.template") -> Callable[[dict], str]:
    """``template`` as a function of the row: a format string over ``PLACEHOLDERS`` or an imported function."""
    if callable(template):
        return template
    if not isinstance(template, str) or not template:
        raise ValueError(f"{key} must be a format string or 'package.module:function', got {template!r}")
    if re.fullmatch(r"[\w.]+:\w+", template):
        function = import_object(template, key)
        if not callable(function):
            raise ValueError(f"{key} {template!r} is not a function")
        return function
    try:
        names = template_placeholders(template)
    except ValueError as exc:
        raise ValueError(f"{key} is not a valid format string ({exc}); write a literal brace as {{{{ or }}}}") from None
    unknown = [name for name in names if name not in PLACEHOLDERS]
    if unknown:
        raise ValueError(f"{key} names placeholder(s) {unknown}; valid: "
                         f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
    return lambda row: template.format(**{name: row.get(name, "") for name in PLACEHOLDERS})


def resolve_parser(parser: str | Callable, key: str = "reward.judge.parser") -> Callable[[str, dict], float | None]:
    """``parser`` as a function of (the verdict, the row): a built-in name or an imported function."""
    if callable(parser):
        return parser
    if parser in PARSERS:
        return PARSERS[parser]
    if isinstance(parser, str) and ":" in parser:
        function = import_object(parser, key)
        if not callable(function):
            raise ValueError(f"{key} {parser!r} is not a function")
        return function
    raise ValueError(f"{key} {parser!r} is not one of the built-in parsers {sorted(PARSERS)} or "
                     f"'package.module:function'")


def checked_score(value: Any) -> float | None:
    """A parser's result as a finite float, or None (no verdict read)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
