"""Roles an algorithm adds to its job (``RLAlgorithm.roles``): each one's worker, and the phase of the step that
calls it.

    class SafeRLHF(RLAlgorithm):
        def roles(self, job):
            spec = job.rule(cost_fn) if cost_fn is not None else job.reward_model(cost_section)
            return {"cost": AlgorithmRole(spec, "score", score_cost)}

The job declares them with its own roles (before any process starts), builds each as a worker group on the
default pool, and calls ``call(group, batch, scores) -> scores`` at the role's phase: ``score``, after the
reward of every batch the step scores (generation rounds and validation included), before the roles
registered with ``controller.rl.role_registry``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from workers.role_spec import RoleSpec

__all__ = ["ALGORITHM_ROLE_PHASES", "AlgorithmRole", "RoleContext"]

ALGORITHM_ROLE_PHASES = ("score",)


@dataclass(frozen=True)
class AlgorithmRole:
    """One role an algorithm adds: its worker (a RoleSpec), the phase that calls it, and the call."""

    spec: RoleSpec
    phase: str  # ALGORITHM_ROLE_PHASES
    call: Callable[..., Any]  # score: (its worker group, the batch, the scores so far) -> the scores

    def __post_init__(self) -> None:
        if not isinstance(self.spec, RoleSpec):
            raise TypeError(f"AlgorithmRole.spec must be a RoleSpec (X.from_pretrained(...)), got {self.spec!r}")
        if self.phase not in ALGORITHM_ROLE_PHASES:
            raise ValueError(f"AlgorithmRole.phase {self.phase!r} is not one of {ALGORITHM_ROLE_PHASES}")
        if not callable(self.call):
            raise TypeError(f"AlgorithmRole.call must be a function, got {self.call!r}")


class RoleContext(Protocol):
    """What a ``roles`` hook declares its roles with: the job's config and the job's way of declaring a scorer."""

    config: Any  # the job's RLConfig
    policy_path: str  # the policy checkpoint (config.model_path, resolved)
    actor_path: str  # the actor's checkpoint (actor.model_path, else the policy's): the tokenizer of its samples

    def rule(self, fn: Any) -> RoleSpec:
        """A rule scorer (a name or an import path of a reward function, or the function), with the job's reward
        options (concurrency, time limit, sandbox) and the actor's tokenizer."""

    def reward_model(self, section: Any) -> RoleSpec:
        """A reward model on ``section`` (a role section: model_path, engine, device_map) reading the policy's
        responses."""
