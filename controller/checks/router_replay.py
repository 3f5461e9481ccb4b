"""``algorithm.router_replay``: a mixture of experts' routes from the rollout, measured or replayed."""

from __future__ import annotations

from controller.checks.facts import JobFacts

__all__ = ["router_replay_problems"]


def router_replay_problems(job: JobFacts) -> list[str]:
    return _router_replay_problems(job.config, job.model_spec)


def _router_replay_problems(config, model_spec) -> list[str]:
    """algorithm.router_replay: a known mode, a mixture of experts, and a rollout that can report its routes."""
    from controller.algorithms.config import ROUTER_REPLAY_MODES

    mode, rollout, trainer = config.algorithm.router_replay, config.rollout, config.trainer
    if mode not in ROUTER_REPLAY_MODES:
        return [f"algorithm.router_replay {mode!r} is not one of {ROUTER_REPLAY_MODES}"]
    if mode == "off":
        return []
    problems = []
    setting = f"algorithm.router_replay {mode}"
    if model_spec is not None and model_spec.moe is None:
        problems.append(f"{setting} is for mixtures of experts; {model_spec.architecture} has no router")
    if rollout.agent is not None:
        problems.append(f"{setting}: multi-turn (rollout.agent) rollouts do not carry their routes yet; use "
                        f"single-turn rollouts or algorithm.router_replay=off")
    if trainer.mode == "async":
        problems.append(f"{setting}: trainer.mode async continues responses across weight updates, whose "
                        f"routes are not carried over yet; use trainer.mode sync or one_step_off")
    if mode == "rollout" and config.actor.engine.recompute_granularity == "full":
        problems.append(f"{setting} with actor.engine.recompute_granularity 'full': the recomputed forward would "
                        f"route afresh; use 'selective' or none")
    if mode == "rollout" and config.actor.engine.moe_capacity_factor is not None:
        problems.append(f"{setting} with actor.engine.moe_capacity_factor {config.actor.engine.moe_capacity_factor}: "
                        f"the capacity would drop replayed tokens that the rollout's experts computed; use "
                        f"moe_capacity_factor null (dropless) or algorithm.router_replay measure")
    return problems
