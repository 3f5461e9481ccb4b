"""JobFacts: what every check of a job reads: the config, the models' specs, the cluster, the pools, the
problems found so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

__all__ = ["JobFacts"]


@dataclass
class JobFacts:
    config: Any  # the job's RLConfig
    model_spec: Any = None  # the policy's ModelSpec (None: the model checks are skipped)
    reward_spec: Any = None  # the reward model's
    cluster: list | None = None  # the Ray cluster's nodes (None: the fit is not checked)
    problems: list[str] = field(default_factory=list)  # found so far, by the checks before

    @cached_property
    def pools(self) -> dict:
        """The job's pools ({} when trainer.placement does not parse: the placement check says why)."""
        from controller.checks.placement import job_pools
        from controller.runtime.placement import PlacementError

        try:
            return job_pools(self.config.trainer)
        except PlacementError:
            return {}

    @property
    def needs_critic(self) -> bool:
        try:
            return self.config.algorithm.needs_critic
        except ValueError:  # an unknown algorithm, listed by its own check
            return False

    @property
    def critic_spec(self) -> Any:
        """The critic's ModelSpec where it is made from the policy."""
        return self.model_spec if self.config.critic.model_path is None else None

    @property
    def role_specs(self) -> dict[str, Any]:
        return {"actor": self.model_spec, "critic": self.critic_spec, "reward.engine": self.reward_spec}
