"""LoRA: which roles take adapters, their targets and rank, a PEFT adapter to start from, and how the
adapters reach the generation engine (``rollout.lora_sync``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from controller.checks.facts import JobFacts
from workers.rollout.generator import generator_traits

__all__ = ["lora_problems", "lora_sync_problems"]


def lora_sync_problems(job: JobFacts) -> list[str]:
    config, rollout, problems = job.config, job.config.rollout, []
    if rollout.lora_sync == "adapter" and not config.actor.lora.enabled:
        problems.append("rollout.lora_sync 'adapter' serves a LoRA actor's adapters, and actor.lora.rank is 0")
    traits = generator_traits(rollout.engine, strict=False)
    if rollout.lora_sync == "adapter" and traits.serves_adapters:
        if config.actor.lora.rank > traits.max_adapter_rank:
            problems.append(f"rollout.lora_sync 'adapter': {rollout.engine} serves LoRA ranks up to "
                            f"{traits.max_adapter_rank}, and actor.lora.rank is {config.actor.lora.rank}; use "
                            f"rollout.lora_sync: merge (or auto)")
    return problems + lora_problems({"actor": (config.actor, job.model_spec),
                                     "critic": (config.critic, job.critic_spec if job.needs_critic else None),
                                     "ref_policy": (config.ref_policy, None)})


def lora_problems(roles: dict[str, tuple[Any, Any]]) -> list[str]:
    """``role.lora`` of each role (key -> (its RoleConfig or None, its ModelSpec or None)): a role that trains
    (actor, critic), targets and a rank the model takes (``check_lora``), an adapter directory that exists."""
    from workers.megatron.lora import check_lora

    problems = []
    for key, (role, spec) in roles.items():
        lora = getattr(role, "lora", None)
        if lora is None or not lora.enabled:
            continue
        if key not in ("actor", "critic"):
            problems.append(f"{key}.lora: LoRA trains adapters, and the {key} does not train; only actor.lora and "
                            f"critic.lora are valid (a LoRA actor's reference is its base, the adapters off)")
            continue
        cp = getattr(getattr(role, "engine", None), "context_parallel", 1)
        if cp > 1:
            problems.append(f"{key}.lora: LoRA with {key}.engine.context_parallel {cp}: context parallelism does not "
                            "take LoRA adapters yet; set context_parallel 1 or train every weight (lora.rank 0)")
        if lora.adapter_path is not None and not (Path(lora.adapter_path) / "adapter_config.json").is_file():
            problems.append(f"{key}.lora.adapter_path {lora.adapter_path!r} is not a PEFT adapter directory (no "
                            f"adapter_config.json)")
        elif lora.adapter_path is not None:
            from workers.megatron.lora_peft import peft_adapter_problems

            saved = json.loads((Path(lora.adapter_path) / "adapter_config.json").read_text())
            problems += [f"{key}.{problem}" for problem in peft_adapter_problems(saved, lora.adapter_path)]
        if spec is not None:
            try:
                check_lora(spec, lora)
            except ValueError as exc:
                problems.append(f"{key}.lora: {exc}")
    return problems
