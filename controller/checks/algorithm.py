"""``algorithm:``: the algorithm found, its estimator registered, its settings in range."""

from __future__ import annotations

from controller.checks.facts import JobFacts
from workers.rollout.agreement import OLD_LOG_PROB_SOURCES

__all__ = ["algorithm_problems"]


def algorithm_problems(job: JobFacts) -> list[str]:
    problems = _algorithm_problems(job.config)
    alg = job.config.algorithm
    if alg.old_log_prob_source not in OLD_LOG_PROB_SOURCES:
        problems.append(f"algorithm.old_log_prob_source {alg.old_log_prob_source!r} is not one of {OLD_LOG_PROB_SOURCES}")
    return problems


def _algorithm_problems(config) -> list[str]:
    """The algorithm found (an import path imported now), its estimator registered, its settings in range."""
    from controller.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from controller.algorithms.algorithm import ALGORITHMS as REGISTERED
    from controller.algorithms.algorithm import own_settings, resolve_algorithm, resolve_rollout_correction
    from controller.algorithms.dapo import DAPO
    from workers.policy_losses import KL_ESTIMATOR_NAMES

    alg, n, max_new = config.algorithm, config.rollout.sampling.n, config.rollout.sampling.max_new_tokens
    try:
        cls, _ = resolve_algorithm(alg.name)
    except ValueError as exc:
        if ":" in alg.name:
            return [str(exc)]
        return [f"algorithm.name {alg.name!r} is not one of the registered algorithms {sorted(REGISTERED)} "
                "(or a module:Class import path)"]
    problems = []
    if not alg.estimator:
        problems.append(f"algorithm.name {alg.name!r} needs algorithm.advantage_estimator (a registered estimator: "
                        f"{sorted(ADVANTAGE_ESTIMATORS)})")
    elif alg.estimator not in ADVANTAGE_ESTIMATORS:
        problems.append(f"advantage estimator {alg.estimator!r} is not registered; registered: {sorted(ADVANTAGE_ESTIMATORS)}")
    # pure on-policy distillation (opd, reward_weight 0) estimates nothing from the task reward
    distils_only = cls.reads_teacher and not getattr(own_settings(cls, alg), "reward_weight", 0.0)
    if distils_only and alg.kl_in_reward:
        problems.append(f"algorithm.kl_in_reward puts a KL penalty in the task reward, which {alg.name} with "
                        "reward_weight 0 does not read; use ppo.use_kl_loss, or algorithm.reward_weight > 0")
    if alg.estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and n < 2 and not distils_only:
        problems.append(f"{alg.estimator} compares samples of one prompt: rollout.sampling.n must be >= 2, got {n}")
    if not issubclass(cls, DAPO):
        for key in ("dynamic_sampling", "overlong_buffer_len"):
            if getattr(alg, key) is not None:
                problems.append(f"algorithm.{key} is a DAPO setting; algorithm.name is {alg.name!r} (use dapo)")
    if alg.max_gen_batches < 1:
        problems.append(f"algorithm.max_gen_batches must be >= 1 (the first generation included), got {alg.max_gen_batches}")
    if alg.overlong_buffer_len is not None and not 0 <= alg.overlong_buffer_len <= max_new:
        problems.append(f"algorithm.overlong_buffer_len must be in [0, rollout.sampling.max_new_tokens = {max_new}], "
                        f"got {alg.overlong_buffer_len}")
    problems += _teacher_problems(config, cls)
    if isinstance(alg.kl_penalty, str) and alg.kl_penalty not in KL_ESTIMATOR_NAMES:
        problems.append(f"algorithm.kl_penalty {alg.kl_penalty!r} is not one of {KL_ESTIMATOR_NAMES}")
    try:
        resolve_rollout_correction(alg.rollout_correction, same_precision=False)
    except ValueError as exc:
        problems.append(f"algorithm.rollout_correction: {exc}")
    return problems


def _teacher_problems(config, cls) -> list[str]:
    """An algorithm that reads a teacher (opd) or a teacher KL term, and the teacher: section they need."""
    import math

    alg, problems = config.algorithm, []
    coef = alg.teacher_kl_coef
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
        return [f"algorithm.teacher_kl_coef must be a finite number >= 0, got {coef!r}"]
    need = "set teacher.model_path (an HF causal LM whose tokenizer is the student's)"
    if "teacher" not in config.roles:
        if cls.reads_teacher:
            problems.append(f"algorithm.name {alg.name!r} distils from a teacher: {need}")
        elif coef:
            problems.append(f"algorithm.teacher_kl_coef={coef} is a KL term to a teacher: {need}")
    return problems
