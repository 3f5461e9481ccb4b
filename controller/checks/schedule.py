"""``trainer.mode`` (sync, one-step-off, async) and the settings each mode takes."""

from __future__ import annotations

from controller.checks.facts import JobFacts

__all__ = ["schedule_problems"]


def schedule_problems(job: JobFacts) -> list[str]:
    return _schedule_problems(job.config.trainer, job.config.algorithm, job.config.rollout)


def _schedule_problems(trainer, alg, rollout) -> list[str]:
    from controller.rl.schedules import TRAINER_MODES

    if trainer.mode not in TRAINER_MODES:
        return [f"trainer.mode {trainer.mode!r} is not one of {TRAINER_MODES}"]
    problems = []
    if trainer.max_staleness < 0:
        problems.append(f"trainer.max_staleness must be >= 0, got {trainer.max_staleness}")
    mode = f"trainer.mode {trainer.mode}"
    if trainer.mode != "async":
        problems += [f"trainer.{key} is a setting of trainer.mode async (this run is {trainer.mode}); drop it"
                     for key in ("partial_rollout_tokens", "max_in_flight") if getattr(trainer, key) is not None]
    if trainer.mode != "sync":
        if "rollout" not in trainer.placement:
            problems.append(f"{mode} overlaps generation with training: give the rollout a pool "
                            f"of its own (trainer.placement.rollout, with trainer.launcher=ray)")
        if alg.name == "dapo" and alg.dynamic_sampling is not False:
            problems.append(f"{mode} does not yet run DAPO's dynamic sampling (its extra generation rounds "
                            f"within a step); set algorithm.dynamic_sampling=false or trainer.mode=sync")
    if trainer.mode == "one_step_off" and trainer.max_staleness < 1:
        problems.append(f"trainer.mode one_step_off trains on samples one update stale: trainer.max_staleness "
                        f"must be >= 1, got {trainer.max_staleness}")
    if trainer.mode == "async":
        tokens, limit = trainer.partial_rollout_tokens, rollout.sampling.max_new_tokens
        if tokens is not None and not (isinstance(tokens, int) and 1 <= tokens <= limit):
            problems.append(f"trainer.partial_rollout_tokens must be an integer in [1, rollout.sampling.max_new_tokens="
                            f"{limit}] (tokens per sample per rollout call), got {tokens!r}")
        if trainer.max_in_flight is not None and not (isinstance(trainer.max_in_flight, int) and trainer.max_in_flight >= 1):
            problems.append(f"trainer.max_in_flight must be a positive integer (prompt groups in generation at once) "
                            f"or null, got {trainer.max_in_flight!r}")
        if rollout.serves_agent:
            problems += [f"trainer.{key} is a setting of the built-in async stream; a served agent's requests take "
                         f"new weights in flight (rollout.server_update: pause or finish): drop it"
                         for key in ("partial_rollout_tokens", "max_in_flight") if getattr(trainer, key) is not None]
            if rollout.lora_sync == "adapter" and rollout.server_update == "pause":
                problems.append("rollout.lora_sync adapter with rollout.server_update pause: vLLM cannot move a request "
                                "in flight onto a new LoRA adapter; use server_update: finish (the requests in flight "
                                "end on the adapter they started with) or lora_sync: merge")
        elif rollout.agent is not None:
            problems.append("trainer.mode async continues single-turn responses across weight updates; built-in "
                            "multi-turn (rollout.agent) conversations run with trainer.mode sync or one_step_off, "
                            "and your own agent (rollout.agent.entrypoint, on rollout.server) with any mode")
    return problems
