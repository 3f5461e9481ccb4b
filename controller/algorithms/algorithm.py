"""RLAlgorithm: the hooks of one RL step, and the registry ``algorithm.name`` looks up.

``RLTrainer.step`` runs the same phases for every algorithm (generate, score, log-probs, advantages,
update, metrics) and calls the algorithm object at five points:

    before_generation(ctx, state, prompts) -> prompts   the prompt batch about to be generated from
    after_scoring(ctx, state, batch) -> batch           scored responses (ReMax's greedy baseline,
                                                        DAPO's dynamic sampling and overlong shaping)
    advantages(ctx, state, batch) -> batch              sets token_level_rewards, advantages, returns
    loss_terms(ctx, state, batch) -> PolicyUpdateTerms  the actor's update's terms: the policy
                                                        objective and the rollout correction
    after_update(ctx, state, batch) -> None             e.g. the adaptive KL coefficient

and may add roles of its own to the job (``roles(job)``: Safe-RLHF's cost scorer).

``ctx`` is the step's ``StepContext`` (``controller.algorithms.step_context``), not the trainer: a
hook may generate and score more (``ctx.generate_and_score``), draw prompts (``ctx.loader``), call
the roles (``ctx.groups``), read the step's settings, and report metrics into ``state.metrics``.
State that must survive a restart goes in ``state_dict`` / ``load_state_dict``: the trainer's
checkpoint keeps it.

An algorithm's own settings are a nested frozen dataclass, ``Config``: its fields are read from the
``algorithm:`` section beside the keys every algorithm shares (``gamma``, ``lam``, the KL settings...),
typed and checked before any process starts, and reach the hooks as ``self.settings``::

    class ScaledGRPO(RLAlgorithm):
        preset = "grpo"

        @dataclass(frozen=True)
        class Config:
            advantage_scale: float = 1.0     # algorithm.advantage_scale

        def advantages(self, ctx, state, batch):
            batch = super().advantages(ctx, state, batch)
            batch.batch["advantages"] *= self.settings.advantage_scale
            return batch

A user's algorithm is a subclass registered by name::

    @register_algorithm("clipped_grpo")
    class ClippedGRPO(RLAlgorithm):
        preset = "grpo"                      # the built-in defaults it starts from

        def advantages(self, ctx, state, batch):
            batch = super().advantages(ctx, state, batch)
            batch.batch["advantages"].clamp_(-2.0, 2.0)
            return batch

and chosen with ``algorithm.name: clipped_grpo`` (imported first), or by import path,
``algorithm.name: my_package.algos:ClippedGRPO``.
"""

from __future__ import annotations

import importlib
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controller.algorithms.advantages import AdvantageConfig, AdvantageInputs, compute_advantages
from controller.algorithms.algorithm_roles import AlgorithmRole, RoleContext
from controller.algorithms.kl_control import KLController, apply_kl_penalty, make_kl_controller
from controller.algorithms.presets import PRESETS, AlgorithmPreset
from workers.actor import PolicyUpdateTerms
from workers.data_proto import DataProto
from workers.rollout_correction import RolloutCorrection

if TYPE_CHECKING:
    from controller.algorithms.step_context import StepContext
    from controller.algorithms.config import AlgorithmConfig

__all__ = [
    "ALGORITHMS",
    "NoSettings",
    "RLAlgorithm",
    "StepState",
    "algorithm_preset",
    "build_algorithm",
    "own_settings",
    "register_algorithm",
    "resolve_algorithm",
    "resolve_rollout_correction",
]


@dataclass
class StepState:
    """What one step's phases share: its number, prompts, timings, metrics and the rollout's metrics, and the
    timeline of its phases on their pools."""

    step: int
    prompts: DataProto | None = None
    timing: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)
    pools: dict[str, str] = field(default_factory=dict)  # phase name -> the pool it runs on (the job's placement)
    phases: list[tuple[str, str, float, float]] = field(default_factory=list)  # (pool, phase, start, end) in s

    @contextmanager
    def timed(self, name: str, pool: str | None = None):
        """Adds the block's wall time to ``timing[name]`` (a phase run twice adds up); on a pool (``pool``, else
        ``pools[name]``) its start and end, from the step's start, go into ``phases`` too."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.timing[name] = self.timing.get(name, 0.0) + end - start
            pool = pool or self.pools.get(name)
            if pool is not None:
                self.phases.append((pool, name, start - self.start, end - self.start))


@dataclass(frozen=True)
class NoSettings:
    """The settings of an algorithm that declares none of its own."""


class RLAlgorithm:
    """The default hooks: an advantage estimator by name, the KL penalty in the reward, the preset's loss."""

    preset: AlgorithmPreset | str | None = None  # a subclass's starting defaults (a built-in name or a preset)
    # The algorithm's own settings: a frozen dataclass whose fields are read from the algorithm: section beside
    # the shared keys (a field's type is checked, its __post_init__ checks values; both before launch)
    Config: type = NoSettings
    reads_teacher: bool = False  # its advantages read a teacher's log-probs (opd): a job needs teacher:

    def __init__(self, config: AlgorithmConfig, preset: AlgorithmPreset) -> None:
        self.config, self.defaults = config, preset
        self.settings = own_settings(type(self), config)
        ctrl = dict(config.kl_ctrl)
        self.kl_ctrl: KLController = make_kl_controller(ctrl.pop("kind", "fixed"), **ctrl)

    # ------------------------------------------------------------- settings
    @property
    def estimator(self) -> str:
        return self.config.advantage_estimator or self.defaults.estimator

    @property
    def needs_critic(self) -> bool:
        return self.estimator == "gae"

    def advantage_config(self) -> AdvantageConfig:
        norm = self.config.norm_adv_by_std
        return AdvantageConfig(gamma=self.config.gamma, lam=self.config.lam,
                               norm_adv_by_std=self.defaults.norm_adv_by_std if norm is None else norm)

    # ---------------------------------------------------------------- hooks
    def before_generation(self, ctx: StepContext, state: StepState, prompts: DataProto) -> DataProto:
        return prompts

    def after_scoring(self, ctx: StepContext, state: StepState, batch: DataProto) -> DataProto:
        return batch

    def advantages(self, ctx: StepContext, state: StepState, batch: DataProto) -> DataProto:
        rewards = batch.batch["token_level_scores"]
        if self.config.kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(rewards, batch.batch["old_log_probs"], batch.batch["ref_log_prob"],
                                                   batch.batch["response_mask"], self.kl_ctrl.value, self.config.kl_penalty)
            state.metrics.update(kl_metrics)
        inputs = AdvantageInputs(rewards, batch.batch["response_mask"], values=batch.batch.get("values"),
                                 group_index=batch.non_tensor_batch.get("uid"),
                                 baseline_rewards=batch.batch.get("baseline_scores"))
        advantages, returns = compute_advantages(self.estimator, inputs, self.advantage_config())
        batch.batch.update({"token_level_rewards": rewards, "advantages": advantages, "returns": returns})
        return batch

    def loss_terms(self, ctx: StepContext, state: StepState, batch: DataProto) -> PolicyUpdateTerms:
        # Off the on-policy path (ctx.mode one_step_off) the samples come from older weights.
        correction = resolve_rollout_correction(self.config.rollout_correction, same_precision=True,
                                                off_policy=ctx.mode != "sync")
        return PolicyUpdateTerms(ctx.ppo.policy_loss_spec(self.defaults.loss_spec()), correction,
                                 norm_length=ctx.max_response_length, teacher_kl_coef=self.config.teacher_kl_coef)

    def after_update(self, ctx: StepContext, state: StepState, batch: DataProto) -> None:
        if self.config.kl_in_reward:
            self.kl_ctrl.update(state.metrics.get("actor/reward_kl_penalty", 0.0), n_steps=len(state.prompts))

    # ---------------------------------------------------------------- roles
    def roles(self, job: RoleContext) -> dict[str, AlgorithmRole]:
        """Roles this algorithm adds to the job beside the built-in ones, by name: each declared with them before
        any process starts, built as a worker group, and called by the step at its phase
        (``controller.algorithms.algorithm_roles``). Safe-RLHF's cost scorer is one; none here."""
        return {}

    # ----------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])


def own_settings(cls: type[RLAlgorithm], config: AlgorithmConfig):
    """``cls.Config`` as ``config`` gives it: parsed from the section (``AlgorithmConfig.split_section``), a
    mapping of its fields, or its defaults."""
    given = getattr(config, "settings", None)
    if given is None:
        return cls.Config()
    if isinstance(given, cls.Config):
        return given
    if isinstance(given, dict):
        return cls.Config(**given)
    raise TypeError(f"algorithm.settings must be a {cls.__name__}.Config or a mapping of its fields, got "
                    f"{type(given).__name__}")


# ------------------------------------------------------------------ resolution (pure)
def resolve_rollout_correction(setting: Any, same_precision: bool, off_policy: bool = False) -> RolloutCorrection:
    """``algorithm.rollout_correction`` as the actor applies it.

    mode "auto" (the default): off where the rollout samples with the trainer's weights at the
    trainer's precision (the colocated path: the two differ only by kernel rounding); truncated IS
    at token level with cap 2 where the precisions differ or the batch is off-policy.
    """
    values = dict(setting) if isinstance(setting, dict) else dict(vars(setting)) if setting is not None else {}
    mode = values.pop("mode", "auto")
    if mode == "auto":
        mode = "off" if same_precision and not off_policy else "tis"
    return RolloutCorrection(mode=mode, **values)


# ------------------------------------------------------------------ registry
#: name -> (hooks class, preset); read it to see what is registered. ReMax and DAPO register their own
#: hooks classes (controller.algorithms.remax / .dapo, imported by the package).
#: "custom": the default hooks with the estimator named by ``algorithm.advantage_estimator``.
CUSTOM = AlgorithmPreset(estimator="")
ALGORITHMS: dict[str, tuple[type[RLAlgorithm], AlgorithmPreset]] = {
    **{name: (RLAlgorithm, preset) for name, preset in PRESETS.items() if name not in ("remax", "dapo")},
    "custom": (RLAlgorithm, CUSTOM),
}


def _as_preset(preset: AlgorithmPreset | str | None, who: str) -> AlgorithmPreset:
    if isinstance(preset, AlgorithmPreset):
        return preset
    if isinstance(preset, str) and preset in PRESETS:
        return PRESETS[preset]
    raise ValueError(f"{who}: preset must be an AlgorithmPreset or a built-in name {sorted(PRESETS)}, got {preset!r}")


def register_algorithm(name: str, preset: AlgorithmPreset | str | None = None, override: bool = False):
    """Class decorator: ``algorithm.name: <name>`` builds this RLAlgorithm subclass.

    ``preset`` (else the class's ``preset`` attribute) gives its defaults: a built-in algorithm's
    name or an ``AlgorithmPreset``.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"algorithm name must be a non-empty string without ':', got {name!r}")

    def decorator(cls: type[RLAlgorithm]) -> type[RLAlgorithm]:
        if not (isinstance(cls, type) and issubclass(cls, RLAlgorithm)):
            raise TypeError(f"algorithm {name!r} must be an RLAlgorithm subclass, got {cls!r}")
        if name in ALGORITHMS and not override and ALGORITHMS[name][0] is not cls:
            raise ValueError(f"algorithm {name!r} is already registered; pass override=True to replace it")
        ALGORITHMS[name] = (cls, _as_preset(preset if preset is not None else cls.preset, f"algorithm {name!r}"))
        return cls

    return decorator


def resolve_algorithm(name: str) -> tuple[type[RLAlgorithm], AlgorithmPreset]:
    """The hooks class and preset of a registered name or of a ``module:Class`` import path."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"algorithm.name {name!r}: cannot import it ({exc})") from None
        if not (isinstance(cls, type) and issubclass(cls, RLAlgorithm)):
            raise ValueError(f"algorithm.name {name!r} is {cls!r}, not an RLAlgorithm subclass")
        return cls, _as_preset(cls.preset, f"algorithm.name {name!r}")
    raise ValueError(f"algorithm.name {name!r} is not registered; registered: {sorted(ALGORITHMS)} "
                     "(or give a module:Class import path)")


def algorithm_preset(name: str) -> AlgorithmPreset:
    return resolve_algorithm(name)[1]


def build_algorithm(config: AlgorithmConfig, safe_rlhf: bool = False) -> RLAlgorithm:
    """The hooks object of ``config.name``; wrapped in Safe-RLHF's when a cost is scored."""
    cls, preset = resolve_algorithm(config.name)
    algorithm = cls(config, preset)
    if safe_rlhf:
        from controller.algorithms.safe_rlhf import SafeRLHF

        algorithm = SafeRLHF(algorithm)
    return algorithm

