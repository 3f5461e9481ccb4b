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
from collections.abc import Callable
from typing import Any

from workers.reward.code_exec import code_exec, code_expression, code_expression_shaped
from workers.reward.text_rules import arithmetic_answer, arithmetic_shaped, final_answer, format_check

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
