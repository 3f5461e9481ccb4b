"""resolve: the config as the job will run it, settled once, before any process starts.

    resolved = resolve(config, algorithm, policy_path, cluster_of, flash_attention=False, placement=placement)
    resolved.config       # the declarations written in, every device_map: auto role laid out, lora_sync chosen
    resolved.lora_sync    # the planner's choice of lora_sync, and why (None: not asked, or not scored)
    resolved.notes        # what to say on the console

It applies, in order: the declarations (``placement``, a ``RolePlacement``: the config's own pools and each
``register_placement``, written into ``trainer.placement``; ``register_parallelism`` writes the roles' layouts
into the config when it is called); each ``device_map: auto`` role's layout (``controller.planner.device_map``);
then how a LoRA actor's adapters reach the rollout (``controller.planner.lora_choice``). Nothing else is read or
changed: ``cluster_of()`` (the job's devices as the planner sees them) is called only where a choice needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controller.config import RLConfig
from controller.rl.role_placement import RolePlacement
from controller.rl.role_specs import declare_roles, with_parallelism

__all__ = ["Resolved", "auto_layout", "lora_sync", "resolve"]

ClusterOf = Callable[[], tuple[Any, Any]]  # () -> (the planner's Cluster, its Efficiency)


@dataclass(frozen=True)
class Resolved:
    config: RLConfig
    lora_sync: Any = None  # a LoRASyncChoice (controller.planner.lora_choice), or None
    notes: tuple[str, ...] = ()


def auto_layout(config: RLConfig, specs: dict, cluster_of: ClusterOf, flash_attention: bool) -> RLConfig:
    """``config`` with each ``device_map="auto"`` role (of ``specs``, without a layout of the user's) at the
    planner's fastest layout that fits the job's devices, as if the user had set it."""
    from controller.planner.device_map import auto_layouts

    auto = {role for role, spec in specs.items() if spec.device_map == "auto" and not spec.explicit_parallelism}
    if not auto:
        return config
    cluster, efficiency = cluster_of()
    for role, (tp, pp, cp) in auto_layouts(config, auto, cluster, efficiency, flash_attention=flash_attention).items():
        config = with_parallelism(config, role, tp, pp, cp if role != "rollout" else None)
    return config


def lora_sync(config: RLConfig, policy_path: str, cluster_of: ClusterOf, flash_attention: bool):
    """``rollout.lora_sync: auto`` settled: (the config, the planner's choice or None, a console note or None).
    A model the planner cannot read gets the mode that runs on every engine, merge."""
    if config.rollout.lora_sync != "auto":
        return config, None, None
    from controller.planner.lora_choice import resolve_lora_sync

    cluster, efficiency = cluster_of() if config.actor.lora.enabled else (None, None)
    try:
        placed, choice = resolve_lora_sync(dataclasses.replace(config, model_path=policy_path), cluster, efficiency,
                                           flash_attention=flash_attention)
    except ValueError as exc:
        return (dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, lora_sync="merge")), None,
                f"rollout.lora_sync auto -> merge: the planner could not score the job ({exc})")
    note = f"rollout.lora_sync auto -> {choice.mode}: {choice.reason}" if choice is not None else None
    return dataclasses.replace(config, rollout=placed.rollout), choice, note


def resolve(config: RLConfig, algorithm: Any, policy_path: str, cluster_of: ClusterOf, flash_attention: bool,
            placement: RolePlacement | None = None) -> Resolved:
    """The declarations (``placement``; None: the config's own pools, as they are), the layouts, then lora_sync,
    as above."""
    if placement is not None:
        config = placement.into(config)
    config = auto_layout(config, declare_roles(config, algorithm, policy_path).specs, cluster_of, flash_attention)
    config, choice, note = lora_sync(config, policy_path, cluster_of, flash_attention)
    return Resolved(config, choice, (note,) if note else ())
