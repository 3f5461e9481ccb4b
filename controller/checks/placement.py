"""Where the job's roles run: its pools (``trainer.placement``, ``nnodes x nproc``), and whether they fit."""

from __future__ import annotations

from controller.checks.facts import JobFacts
from controller.runtime.placement import PlacementError, PoolShape, fit_pools, pool_shape

__all__ = ["PLACEABLE_ROLES", "distinct_pools", "job_pools", "placeable_roles", "placement_problems"]

PLACEABLE_ROLES = ("actor", "rollout", "critic", "ref_policy", "reward_model", "reward", "judge")


def job_pools(trainer) -> dict[str, PoolShape]:
    """The job's pools: "default" (nnodes x nproc) and one per placed role; PlacementError on a bad entry.

    An entry that names another placed role (``trainer.placement={critic: 4, reward_model: critic}``)
    shares that role's pool: both map to the same ``PoolShape``, named after the role that owns it.
    """
    pools = {"default": PoolShape("default", trainer.nnodes, trainer.nproc)}
    for role, value in trainer.placement.items():
        if role not in placeable_roles():
            raise PlacementError(f"trainer.placement: {role!r} is not a placeable role; valid: {PLACEABLE_ROLES}")
        if not isinstance(value, str):
            pools[role] = pool_shape(role, value, f"trainer.placement.{role}")
    for role, value in trainer.placement.items():
        if isinstance(value, str):
            owners = sorted(r for r, v in trainer.placement.items() if not isinstance(v, str))
            if value not in owners:
                raise PlacementError(f"trainer.placement.{role}: {value!r} names no role placed on a pool of its own; "
                                     f"name one of {owners}, or give a number of processes or "
                                     "{nodes, processes_per_node}")
            if "rollout" in (role, value):
                raise PlacementError(f"trainer.placement.{role}: {value!r}: a rollout on its own pool shares it with "
                                     "no other role (it sits with the actor when not placed)")
            pools[role] = pools[value]
    return pools


def distinct_pools(pools: dict[str, PoolShape]) -> list[PoolShape]:
    """Each pool once (roles sharing a pool map to one shape)."""
    return list({shape.name: shape for shape in pools.values()}.values())


def placement_problems(job: JobFacts) -> list[str]:
    """The pools parse, split pools run under Ray, and (given a cluster) fit it."""
    trainer, problems = job.config.trainer, []
    try:
        job_pools(trainer)
    except PlacementError as exc:
        problems.append(str(exc))
    if trainer.placement and trainer.launcher == "torchrun":
        problems.append("trainer.placement (split pools) needs trainer.launcher=ray: under torchrun every "
                        "megatron role spans the whole world")
    if job.cluster is not None and not job.problems and not problems:
        try:
            fit_pools(distinct_pools(job.pools), job.cluster)
        except PlacementError as exc:
            problems.append(f"trainer.placement / trainer.nnodes x nproc do not fit the Ray cluster: {exc}")
    return problems


def placeable_roles() -> tuple[str, ...]:
    """The roles a pool may be given to: the built-in ones, and those registered beside them
    (``controller.rl.role_registry``)."""
    from controller.rl.role_registry import ROLE_TYPES

    return (*PLACEABLE_ROLES, *ROLE_TYPES)
