"""Safe-RLHF (Dai et al. 2023): reward and cost advantages traded off by a Lagrange multiplier.

The policy maximises J_r subject to J_c <= cost_limit, where J_c is the expected
episode cost from a separate cost model. The Lagrangian J_r - lambda * (J_c - limit)
is maximised over the policy and minimised over lambda >= 0, which gives gradient
ascent on lambda along the constraint violation J_c - limit.

``SafeRLHF`` wraps any critic-free algorithm's hooks: after its own advantages it
computes the cost's with the same estimator (ReMax's greedy cost baseline
included), combines the two under the multiplier, and steps the multiplier after
the update; the multiplier is part of the checkpoint.

Everything Safe-RLHF adds to a job is here: its role (``roles``: the cost scorer, a rule
``algorithm.safe_rlhf_cost_fn`` or a reward model ``cost_model:``, called in the score phase by
``score_cost``), whether a job has it (``costed``), and its hooks. Its settings keep their spellings
(``algorithm.safe_rlhf_cost_limit``, ``..._lambda_init``, ``..._lambda_lr``).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from controller.algorithms.advantages import AdvantageInputs, compute_advantages
from controller.algorithms.algorithm import RLAlgorithm, StepState
from controller.algorithms.algorithm_roles import AlgorithmRole, RoleContext
from controller.errors import ConfigError
from workers.data_proto import DataProto

__all__ = ["LagrangeMultiplier", "SafeRLHF", "check_cost_sources", "combine_advantages", "costed", "score_cost"]


def costed(config) -> bool:
    """Whether a job (an RLConfig) scores a cost, which turns Safe-RLHF on."""
    return config.algorithm.safe_rlhf_cost_fn is not None or config.cost_model is not None


def check_cost_sources(cost_fn, cost_model) -> None:
    """ConfigError unless at most one cost source is given."""
    if cost_fn is not None and cost_model is not None:
        raise ConfigError("give cost_fn (a rule) or cost_model (a RewardModel spec), not both")


def score_cost(group, batch: DataProto, scores: DataProto, score_key: str = "rm_scores") -> DataProto:
    """``scores`` with the cost of each response (``cost_token_level_scores``, ``cost_scores``) from the cost
    role's worker group: a reward model's ``score_key``, or a rule's ``scores``."""
    if hasattr(group, "compute_rm_score"):
        cost = group.compute_rm_score(batch)
        cost_scores = cost.batch[score_key]
    else:
        cost = group.compute_reward(batch)
        cost_scores = cost.batch["scores"]
    return scores.union(DataProto({"cost_token_level_scores": cost.batch["token_level_scores"],
                                   "cost_scores": cost_scores}))


def _finite(owner: str, name: str, value: Any, minimum: float | None = None, strict: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if strict else value >= minimum
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum}"
        raise ValueError(f"{owner}: {name} must be a finite number{bound}, got {value!r}")
    return float(value)


class LagrangeMultiplier:
    """lambda >= 0 for the cost constraint J_c <= cost_limit, updated by projected gradient ascent.

        lambda <- min(max(0, lambda + lr * (J_c - cost_limit)), max_lambda)

    We update lambda itself rather than log lambda (the Safe-RLHF code's choice,
    stepped with Adam): the plain projected step can reach exactly 0, which
    switches the cost term off once the constraint holds with slack, and each
    step is easy to reason about (a constant-size move per unit of violation).
    ``max_lambda`` (None: no cap) keeps the cost term from swamping the reward.
    """

    def __init__(self, init: float = 1.0, lr: float = 0.1, cost_limit: float = 0.0, max_lambda: float | None = None) -> None:
        self.lr = _finite("LagrangeMultiplier", "lr", lr, minimum=0.0, strict=True)
        self.cost_limit = _finite("LagrangeMultiplier", "cost_limit", cost_limit)
        self.max_lambda = None if max_lambda is None else _finite("LagrangeMultiplier", "max_lambda", max_lambda, minimum=0.0)
        self.value = self._checked_value(init, "init")

    def _checked_value(self, value: Any, name: str) -> float:
        value = _finite("LagrangeMultiplier", name, value, minimum=0.0)
        if self.max_lambda is not None and value > self.max_lambda:
            raise ValueError(f"LagrangeMultiplier: {name} must be <= max_lambda ({self.max_lambda}), got {value!r}")
        return value

    def update(self, mean_episode_cost: float | torch.Tensor) -> float:
        """One ascent step from the batch's mean episode cost J_c; returns the new lambda."""
        cost = _finite("LagrangeMultiplier.update", "mean_episode_cost", float(mean_episode_cost))
        value = max(0.0, self.value + self.lr * (cost - self.cost_limit))
        if self.max_lambda is not None:
            value = min(value, self.max_lambda)
        self.value = value
        return value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "value" not in state:
            raise ValueError(f"LagrangeMultiplier.load_state_dict: missing key 'value'; got keys {sorted(state)}")
        self.value = self._checked_value(state["value"], "value")


def combine_advantages(
    reward_advantages: torch.Tensor, cost_advantages: torch.Tensor, lam: float | torch.Tensor
) -> torch.Tensor:
    """The policy's advantage under the Lagrangian, rescaled to stay bounded as lambda grows:

        A = (A_r - lambda * A_c) / (1 + lambda)
    """
    if reward_advantages.shape != cost_advantages.shape:
        raise ValueError(
            f"combine_advantages: cost_advantages shape {tuple(cost_advantages.shape)} "
            f"must equal reward_advantages shape {tuple(reward_advantages.shape)}"
        )
    if isinstance(lam, torch.Tensor):
        if lam.numel() != 1:
            raise ValueError(f"combine_advantages: lam must be a scalar, got shape {tuple(lam.shape)}")
        lam_value = float(lam)
    else:
        lam_value = lam
    _finite("combine_advantages", "lam", lam_value, minimum=0.0)
    return (reward_advantages - lam * cost_advantages) / (1 + lam)


class SafeRLHF(RLAlgorithm):
    """``inner``'s hooks, with the cost advantages folded in and the Lagrange multiplier stepped."""

    def __init__(self, inner: RLAlgorithm) -> None:
        self.inner, self.config, self.defaults = inner, inner.config, inner.defaults
        self.kl_ctrl = inner.kl_ctrl
        cfg = inner.config
        self.lagrange = LagrangeMultiplier(cfg.safe_rlhf_lambda_init, cfg.safe_rlhf_lambda_lr, cfg.safe_rlhf_cost_limit)

    @property
    def estimator(self) -> str:
        return self.inner.estimator

    def roles(self, job: RoleContext) -> dict[str, AlgorithmRole]:
        """The inner algorithm's roles and the cost scorer: ``algorithm.safe_rlhf_cost_fn`` (a rule) or
        ``cost_model:`` (a reward model), scoring every batch beside the reward."""
        cost_fn, cost_model = job.config.algorithm.safe_rlhf_cost_fn, job.config.cost_model
        check_cost_sources(cost_fn, cost_model)
        if cost_fn is None and cost_model is None:
            raise ConfigError("Safe-RLHF scores a cost: set algorithm.safe_rlhf_cost_fn (a rule) or cost_model "
                              "(a reward model)")
        if self.needs_critic:
            raise ConfigError("Safe-RLHF costs here use a critic-free estimator (grpo, rloo, remax, "
                              f"reinforce_plus_plus); {self.config.name} would need a cost critic")
        spec = job.rule(cost_fn) if cost_fn is not None else job.reward_model(cost_model)
        call = partial(score_cost, score_key=spec.kwargs.get("score_key", "rm_scores"))
        return {**self.inner.roles(job), "cost": AlgorithmRole(spec, "score", call)}

    def before_generation(self, ctx, state: StepState, prompts: DataProto) -> DataProto:
        return self.inner.before_generation(ctx, state, prompts)

    def after_scoring(self, ctx, state: StepState, batch: DataProto) -> DataProto:
        return self.inner.after_scoring(ctx, state, batch)

    def advantages(self, ctx, state: StepState, batch: DataProto) -> DataProto:
        batch = self.inner.advantages(ctx, state, batch)
        cost_inputs = AdvantageInputs(batch.batch["cost_token_level_scores"], batch.batch["response_mask"],
                                      group_index=batch.non_tensor_batch.get("uid"),
                                      baseline_rewards=batch.batch.get("baseline_cost_scores"))
        cost_advantages, _ = compute_advantages(self.estimator, cost_inputs, self.inner.advantage_config())
        batch.batch["advantages"] = combine_advantages(batch.batch["advantages"], cost_advantages, self.lagrange.value)
        state.metrics.update({"safe_rlhf/lambda": self.lagrange.value,
                              "safe_rlhf/cost/mean": float(batch.batch["cost_scores"].mean())})
        return batch

    def loss_terms(self, ctx, state: StepState, batch: DataProto):
        return self.inner.loss_terms(ctx, state, batch)

    def after_update(self, ctx, state: StepState, batch: DataProto) -> None:
        self.inner.after_update(ctx, state, batch)
        self.lagrange.update(state.metrics["safe_rlhf/cost/mean"])

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "lagrange": self.lagrange.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        if state.get("lagrange"):
            self.lagrange.load_state_dict(state["lagrange"])
