"""A vision-language policy's checks: what generates from its images, and what does not yet take them."""

from __future__ import annotations

from controller.checks.facts import JobFacts

__all__ = ["vision_problems"]


def vision_problems(job: JobFacts) -> list[str]:
    from workers.rollout.generator import generator_traits, registered_generators

    config, spec = job.config, job.model_spec
    if spec is None or spec.vision is None:
        if not config.actor.freeze_vision_tower and spec is not None:
            return [f"actor.freeze_vision_tower false: {spec.architecture} has no vision tower"]
        return []
    problems = []
    rollout = config.rollout
    if rollout.engine in registered_generators() and not generator_traits(rollout.engine).takes_images:
        problems.append(f"rollout.engine {rollout.engine!r} generates text only; {spec.architecture} is a "
                        "vision-language model: generate with rollout.engine vllm")
    if rollout.agent is not None:
        problems.append(f"rollout.agent: multi-turn agents carry text observations only; {spec.architecture} is a "
                        "vision-language model (train it single-turn: drop rollout.agent)")
    trainer = config.trainer
    if trainer.mode != "sync" or "rollout" in trainer.placement:
        problems.append(f"trainer.mode {trainer.mode!r} / trainer.placement: a rollout on a pool of its own takes its "
                        "weights across pools, which carry no vision tower yet; a vision-language model trains with "
                        "the rollout colocated (trainer.mode sync, no placement.rollout)")
    if job.needs_critic:
        problems.append(f"algorithm {config.algorithm.name!r} trains a critic, and a critic on a vision-language "
                        f"model ({spec.architecture}) is not supported yet; use a critic-free algorithm "
                        "(grpo, rloo, reinforce_pp, ...)")
    return problems
