"""``reward:``: one way to score, and reward and cost functions found and bound now."""

from __future__ import annotations

from controller.checks.facts import JobFacts

__all__ = ["reward_problems"]


def reward_problems(job: JobFacts) -> list[str]:
    return _reward_problems(job.config)


def _reward_problems(config) -> list[str]:
    """Reward and cost functions found and their signatures bound now, not in a worker after start-up."""
    from workers.reward.router import check_reward_fn

    reward, alg = config.reward, config.algorithm
    problems = []
    if reward.worker is not None and reward.model_path is not None:
        problems.append("reward: reward.worker (your own worker) and reward.model_path (a reward model) are both "
                        "set; give one")
    elif reward.fn is None and reward.model_path is None and reward.worker is None:
        problems.append("reward: set reward.fn (a rule) or reward.model_path (a reward model), or reward.worker "
                        "(your own worker)")
    if reward.timeout_s is not None and not reward.timeout_s > 0:
        problems.append(f"reward.timeout_s must be a positive number of seconds or null (no limit), got "
                        f"{reward.timeout_s!r}")
    if reward.max_concurrency is not None and reward.max_concurrency < 1:
        problems.append(f"reward.max_concurrency must be a positive integer or null, got {reward.max_concurrency!r}")
    by_fn = reward.model_path is None and reward.worker is None and reward.fn is not None
    checks = [("reward.fn", reward.fn)] if by_fn else []
    if alg.safe_rlhf_cost_fn is not None:
        checks.append(("algorithm.safe_rlhf_cost_fn", alg.safe_rlhf_cost_fn))
    for key, spec in checks:
        try:
            check_reward_fn(spec, reward.kwargs if key == "reward.fn" else None, key)
        except ValueError as exc:
            problems.append(str(exc))
    return problems
