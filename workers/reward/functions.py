"""Rule-based reward functions: the built-ins and how a name or import path becomes one.

A reward function scores one sample as text::

    def my_reward(prompt: str, response: str, ground_truth: str | None, extra: dict, **kwargs) -> float

- ``prompt``: the prompt's valid tokens decoded, special tokens skipped;
- ``response``: the response's valid tokens decoded the same way; for a
  multi-turn (agent) rollout, the model's last turn (the whole conversation
  is in ``extra["agent_messages"]``);
- ``ground_truth``: the sample's ``ground_truth`` field, or None when the
  batch carries none;
- ``extra``: the sample's other non-tensor fields (``{"data_source": ...}``,
  say), keyed by field name;
- ``kwargs``: the ``reward_kwargs`` the reward worker was built with (none
  by default).

It returns a finite real number (a bool is refused: it is too often a
forgotten ``float(...)``). ``RuleReward`` takes a function object, a name
from ``REWARD_FUNCTIONS`` or an import path ``"package.module:function"``.

Built-ins (all expect a ground truth and raise ValueError without one):

- ``arithmetic_answer``: 1.0 if the response's final answer equals the
  ground truth's as a number, else 0.0 (see ``final_answer``);
- ``format_check``: 1.0 if the response ends with ``#### <number>``, else 0.0
  (this one ignores the ground truth);
- ``arithmetic_shaped``: ``arithmetic_answer`` with partial credit for a tiny
  model learning from scratch (see its docstring).

And one for multi-turn rollouts: ``environment``, the reward the rollout's
environment gave over the conversation (``extra["agent_reward"]``).

Three run the response's code in the sandbox (``workers.sandbox``; defined
in ``workers.reward.code_exec``):

- ``code_exec``: the response's program (its last ```python block, else
  the whole response) against the ground truth: the fraction of a JSON list
  of test cases (``[{"stdin": ..., "expected": ...}, ...]``) whose stdout
  matches, or 1.0 / 0.0 for an expected stdout;
- ``code_expression``: 1.0 if ``print((<the response's expression>))``
  prints the ground truth, else 0.0;
- ``code_expression_shaped``: that, with partial credit for a printed
  number near the target (the tiny model's example, examples/code_expression.yaml).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from workers.reward.code_exec import code_exec, code_expression, code_expression_shaped

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFn",
    "arithmetic_answer",
    "arithmetic_shaped",
    "final_answer",
    "format_check",
    "resolve_reward_fn",
]

RewardFn = Callable[..., float]

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


def environment(prompt: str, response: str, ground_truth: str | None, extra: dict, **kwargs: Any) -> float:
    """The environment's reward for a multi-turn rollout's conversation (``rollout.agent.environment``)."""
    if "agent_reward" not in extra:
        raise ValueError("reward fn 'environment' scores multi-turn rollouts: the sample has no agent_reward "
                         "(set rollout.agent, or choose another reward.fn)")
    if extra["agent_reward"] is None:
        raise ValueError("reward fn 'environment': the agent (rollout.agent.entrypoint) returned None for this "
                         "sample; return its reward, or choose a reward.fn that scores the last assistant message")
    return float(extra["agent_reward"])


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "arithmetic_answer": arithmetic_answer,
    "environment": environment,
    "format_check": format_check,
    "arithmetic_shaped": arithmetic_shaped,
    "code_exec": code_exec,
    "code_expression": code_expression,
    "code_expression_shaped": code_expression_shaped,
}


def resolve_reward_fn(spec: str | RewardFn) -> RewardFn:
    """A reward function from a callable, a ``REWARD_FUNCTIONS`` name or ``"package.module:function"``.

    Raises ValueError for an unknown name or a malformed path, ImportError
    when the module does not import, AttributeError when it lacks the
    function, and TypeError when what was found is not callable.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"a reward function must be a callable, a built-in name or 'package.module:function'; "
            f"got {type(spec).__name__} {spec!r}"
        )
    if ":" not in spec:
        try:
            return REWARD_FUNCTIONS[spec]
        except KeyError:
            raise ValueError(
                f"unknown reward function {spec!r}; built-in functions: {sorted(REWARD_FUNCTIONS)}, "
                f"or give an import path 'package.module:function'"
            ) from None
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"reward function path {spec!r} must have the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ImportError(
            f"reward function {spec!r}: module {module_name!r} failed to import ({type(exc).__name__}: {exc})"
        ) from exc
    target: Any = module
    for part in attr.split("."):  # "module:Class.method" works too
        if not hasattr(target, part):
            raise AttributeError(f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"reward function {spec!r} is a {type(target).__name__}, not a callable")
    return target
