"""RL algorithms: the hooks objects of the RL step (RLAlgorithm and its registry), and the pure tensor
functions they call: advantage estimators, KL control, DAPO's shaping and filtering, Safe-RLHF."""

from controller.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageEstimator,
    AdvantageInputs,
    compute_advantages,
    get_advantage_estimator,
    group_rows,
    masked_var,
    masked_whiten,
    register_advantage_estimator,
)
from controller.algorithms.kl_control import (
    KL_CONTROLLER_KINDS,
    KL_KIND_ALIASES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    Schedule,
    ScheduledKLController,
    apply_kl_penalty,
    cosine_schedule,
    exponential_decay,
    linear_schedule,
    make_kl_controller,
)
from controller.algorithms.algorithm import (
    ALGORITHMS,
    RLAlgorithm,
    StepState,
    algorithm_preset,
    build_algorithm,
    register_algorithm,
    resolve_algorithm,
    resolve_rollout_correction,
)
from controller.algorithms.dapo import DAPO, informative_groups, overlong_penalty
from controller.algorithms.opd import OPD, distillation_advantages
from controller.algorithms.presets import PRESETS, AlgorithmPreset
from controller.algorithms.remax import ReMax
from controller.algorithms.safe_rlhf import LagrangeMultiplier, SafeRLHF, combine_advantages
from controller.algorithms.step_context import StepContext

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ALGORITHMS",
    "AlgorithmPreset",
    "DAPO",
    "OPD",
    "PRESETS",
    "RLAlgorithm",
    "ReMax",
    "SafeRLHF",
    "StepContext",
    "StepState",
    "algorithm_preset",
    "build_algorithm",
    "distillation_advantages",
    "informative_groups",
    "overlong_penalty",
    "register_algorithm",
    "resolve_algorithm",
    "resolve_rollout_correction",
    "KL_CONTROLLER_KINDS",
    "KL_KIND_ALIASES",
    "AdaptiveKLController",
    "AdvantageConfig",
    "AdvantageEstimator",
    "AdvantageInputs",
    "FixedKLController",
    "KLController",
    "LagrangeMultiplier",
    "Schedule",
    "ScheduledKLController",
    "apply_kl_penalty",
    "combine_advantages",
    "compute_advantages",
    "cosine_schedule",
    "exponential_decay",
    "get_advantage_estimator",
    "group_rows",
    "linear_schedule",
    "make_kl_controller",
    "masked_var",
    "masked_whiten",
    "register_advantage_estimator",
]
