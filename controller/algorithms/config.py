"""``algorithm:``, the algorithms' own section of the job's config: which algorithm, its estimator's
knobs, the KL in the reward, the old log-probs' source, Safe-RLHF, the rollout correction and DAPO's
settings. ``controller.config`` gathers it into the job's tree; the checks that need the registries
(``controller.config.check_config``) run there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROUTER_REPLAY_MODES = ("off", "measure", "rollout")

__all__ = ["AlgorithmConfig", "RolloutCorrectionConfig"]


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance weights between the rollout engine's log-probs and the trainer's (workers.rollout_correction)."""

    mode: str = "auto"  # auto (off when rollout and training share weights and precision), off, tis or mis
    level: str = "token"  # token or sequence
    cap: float = 2.0  # tis: the weights' cap
    low: float = 0.5  # mis: the ratio's bounds
    high: float = 2.0  # mis: a token or sequence whose ratio is outside [low, high] gets weight 0


@dataclass(frozen=True)
class AlgorithmConfig:
    """The RL algorithm: its advantage estimator's knobs, the KL terms, Safe-RLHF and DAPO's settings."""

    # A registered algorithm (ALGORITHMS, or one registered with register_algorithm), or module:Class
    name: str = "ppo"
    advantage_estimator: str | None = None  # overrides the algorithm's estimator (a registered name)
    gamma: float = 1.0  # the discount factor (GAE, REINFORCE++ returns)
    lam: float = 1.0  # GAE's lambda
    norm_adv_by_std: bool | None = None  # GRPO-family: divide by the group std; None: the algorithm's (dr_grpo: no)
    kl_in_reward: bool = False  # KL penalty in the reward (PPO-RLHF style); the loss form is actor.ppo.use_kl_loss
    kl_penalty: str = "k1"  # kl_in_reward's per-token estimator: k1, k2 or k3 (or kl, mse, low_var_kl)
    # kl_in_reward's coefficient beta: {kind: fixed, value}, {kind: adaptive, init_kl_coef, target_kl, horizon},
    # or a linear / exponential / cosine schedule (controller.algorithms.kl_control.make_kl_controller)
    kl_ctrl: dict[str, Any] = field(default_factory=lambda: {"kind": "fixed", "value": 0.001})
    # The PPO ratio's old log-probs: "auto" (the update's own forward when provably on-policy, else
    # "recompute"), "recompute" (a separate forward of the actor) or "rollout" (the engine's)
    old_log_prob_source: str = "auto"
    use_reference: bool | None = None  # None: when a KL term needs it
    # Your KL term in the actor's loss: "package.module:function" or a function
    # fn(actor_outputs, ref_outputs, step) -> loss (workers.user_kl); it reads a reference policy
    kl_loss_fn: str | Callable | None = None
    safe_rlhf_cost_fn: str | Callable | None = None  # a reward function scoring cost; turns on Safe-RLHF
    safe_rlhf_cost_limit: float = 0.0  # the constraint: the mean episode cost at most this
    safe_rlhf_lambda_init: float = 1.0  # the Lagrange multiplier lambda's first value
    safe_rlhf_lambda_lr: float = 0.1  # lambda's step: lambda + lr * (mean cost - cost_limit), kept >= 0
    # The teacher (teacher: section) as a KL term in the actor's loss, KL(actor || teacher) by ppo.kl_loss_type at
    # this weight, in place of (or beside) the reference's; 0: none. algorithm.name: opd reads the teacher anyway
    teacher_kl_coef: float = 0.0
    # A mixture of experts' rollout routing replay (R3): "off"; "rollout" (the experts the rollout chose for
    # each token travel with the batch, and the actor's routers replay them in its log-prob and update passes);
    # "measure" (they travel with the batch and are only compared: router_replay/agreement without replay)
    router_replay: str = "off"
    # importance weights between the rollout engine's log-probs and the trainer's
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # DAPO (algorithm.name: dapo)
    dynamic_sampling: bool | None = None  # drop prompt groups whose rewards are all equal; None: dapo's (on)
    max_gen_batches: int = 10  # generation rounds per step at most, the first included
    overlong_buffer_len: int | None = None  # tokens before max_new_tokens where the penalty grows; None: 20%
    overlong_penalty_factor: float = 1.0  # the penalty at max_new_tokens
    # The algorithm's own settings: its class's nested ``Config``, parsed from the algorithm: keys that no
    # algorithm shares (``split_section``); None: that Config's defaults
    settings: Any = None

    @classmethod
    def split_section(cls, value: dict[str, Any], where: str, build: Callable[[Any, Any, str], Any]) -> dict[str, Any]:
        """The ``algorithm:`` mapping with the keys of the algorithm's own ``Config`` gathered, typed, into
        ``settings`` (``build(cls, value, where)`` types a section, errors naming the key). Unchanged when the
        algorithm declares no settings of its own, or cannot be found (its checks say so)."""
        from controller.algorithms.algorithm import resolve_algorithm
        from controller.errors import ConfigError

        shared = {f.name for f in dataclasses.fields(cls) if f.init}
        extra = {k: v for k, v in value.items() if k not in shared}
        given = value.get("settings")
        try:
            own = resolve_algorithm(value.get("name", cls.name))[0].Config
        except ValueError:
            return value
        own_keys = {f.name for f in dataclasses.fields(own) if f.init}
        if not own_keys or not (extra or isinstance(given, dict)):
            return value
        unknown = sorted(set(extra) - own_keys)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(shared - {'settings'})}, and "
                              f"{value.get('name')}'s own: {sorted(own_keys)}")
        settings = build(own, {**(given if isinstance(given, dict) else {}), **extra}, where)
        return {**{k: v for k, v in value.items() if k in shared}, "settings": settings}

    @property
    def estimator(self) -> str:
        from controller.algorithms.algorithm import algorithm_preset

        return self.advantage_estimator or algorithm_preset(self.name).estimator

    @property
    def needs_critic(self) -> bool:
        return self.estimator == "gae"
