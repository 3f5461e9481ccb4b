"""The default reward: a scorer chosen per sample by its ``data_source`` (``reward.fn: auto``).

Data sources are named as verl names them, so verl-preprocessed files score
out of the box:

- ``openai/gsm8k`` / ``gsm8k``: the final answer (after ``####``) as a number;
- MATH (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
  ``HuggingFaceH4/MATH-500``, ``math``): answer equivalence by ``math-verify``;
- ``arithmetic`` (the built-in task): ``arithmetic_shaped``, whose partial
  credit lets a tiny random model start learning;
- ``code_expression`` (the built-in task): ``code_expression_shaped``, which
  runs the response in the sandbox (``workers.sandbox``).

Everything here is also checked before launch: ``check_reward_fn`` imports
a named function and binds the reward signature to it, and
``unknown_data_sources`` lists the sources no scorer knows.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from workers.reward.code_exec import code_expression_shaped
from workers.reward.functions import RewardFn, arithmetic_answer, arithmetic_shaped, resolve_reward_fn
from workers.reward.math_answer import math_equivalence

__all__ = ["AUTO", "DATA_SOURCE_SCORERS", "check_reward_fn", "resolve_scorer", "score_by_data_source",
           "scorer_for", "unknown_data_sources"]

AUTO = "auto"

DATA_SOURCE_SCORERS: dict[str, RewardFn] = {
    "arithmetic": arithmetic_shaped,
    "code_expression": code_expression_shaped,  # runs the response in the sandbox
    "gsm8k": arithmetic_answer,
    "openai/gsm8k": arithmetic_answer,
    "math": math_equivalence,
    "lighteval/MATH": math_equivalence,
    "DigitalLearningGmbH/MATH-lighteval": math_equivalence,
    "HuggingFaceH4/MATH-500": math_equivalence,
}


def _unknown_message(source: Any) -> str:
    return (f"no reward function for data_source {source!r}; known data sources: {sorted(DATA_SOURCE_SCORERS)}. "
            f"Set reward.fn to a built-in name or 'package.module:function' to score it")


def scorer_for(data_source: Any) -> RewardFn:
    try:
        return DATA_SOURCE_SCORERS[data_source]
    except (KeyError, TypeError):
        raise ValueError(_unknown_message(data_source)) from None


def score_by_data_source(prompt: str, response: str, ground_truth: Any, extra: dict, **kwargs: Any) -> float:
    """The score of the scorer registered for ``extra["data_source"]``."""
    return scorer_for(extra.get("data_source"))(prompt, response, ground_truth, extra, **kwargs)


def unknown_data_sources(sources: Iterable[Any]) -> list[Any]:
    """The distinct sources (None included: rows without one) that ``score_by_data_source`` cannot score."""
    return sorted({s for s in sources if s not in DATA_SOURCE_SCORERS}, key=repr)


def resolve_scorer(spec: str | RewardFn) -> RewardFn:
    """``"auto"``: route by data source; anything else as ``resolve_reward_fn`` takes it."""
    return score_by_data_source if spec == AUTO else resolve_reward_fn(spec)


def check_reward_fn(spec: str | RewardFn, kwargs: dict[str, Any] | None = None, key: str = "reward.fn") -> RewardFn:
    """The function ``spec`` names, checked to accept ``(prompt, response, ground_truth, extra, **kwargs)``.

    Raises ValueError naming ``key`` when it cannot be found or imported, or
    when its signature does not bind those arguments (with ``kwargs``).
    """
    try:
        fn = resolve_scorer(spec)
    except (ValueError, ImportError, AttributeError, TypeError) as exc:
        raise ValueError(f"{key}: {exc}") from None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin or C callable without a signature: nothing to check here
    try:
        signature.bind("prompt", "response", "ground truth", {}, **(kwargs or {}))
    except TypeError as exc:
        extra = f" and the keyword arguments {sorted(kwargs)} (reward.kwargs)" if kwargs else ""
        raise ValueError(f"{key}: {spec!r} has the signature {signature}, which does not accept "
                         f"(prompt, response, ground_truth, extra){extra}: {exc}. A reward function is "
                         f"def fn(prompt, response, ground_truth, extra, **kwargs) -> float") from None
    return fn
