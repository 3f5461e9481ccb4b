"""RolePlacement: where a job's roles run, as declared (the config's ``trainer.placement``, then each
``register_placement``), a value that ``resolve`` writes into the config before any process starts.

    placement = RolePlacement.of(config.trainer, roles)            # the config's own pools
    placement = placement.placed("critic", devices=4)             # register_placement("critic", 4)
    placement = placement.placed("actor", devices=2, pool="policy")
    config = placement.into(config)                                # trainer.placement as declared

Each call gives a new value (nothing is changed in place), and a bad declaration is refused at the call,
naming it. The rollout follows the actor's pool unless it is placed itself; then the actor sends it the
weights across pools.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from controller.checks.placement import job_pools, placeable_roles
from controller.errors import ConfigError
from controller.runtime.placement import PlacementError, PoolShape, pool_shape

__all__ = ["RolePlacement"]


@dataclass(frozen=True)
class RolePlacement:
    """Each pool's shape by name ("default": ``nnodes x nproc``), each role's pool, and whether the rollout has
    a pool of its own."""

    shapes: dict[str, PoolShape]
    roles: dict[str, str]
    rollout_apart: bool = False

    @classmethod
    def of(cls, trainer, roles: Iterable[str]) -> "RolePlacement":
        """Every role on "default", then the pools of the config's own ``trainer.placement``: each pool's owner
        first, then the roles sharing it."""
        placement = cls({"default": PoolShape("default", trainer.nnodes, trainer.nproc)},
                        {role: "default" for role in roles})
        pools = job_pools(trainer)
        for role, shape in sorted(pools.items(), key=lambda item: item[1].name != item[0]):
            if role == "default":
                continue
            if shape.name == role:
                placement = placement.placed(role, nodes=shape.nodes, processes_per_node=shape.processes_per_node)
            else:
                placement = placement.placed(role, pool=shape.name)
        return placement

    def placed(self, role: str, devices: int | None = None, pool: str | None = None, *,
               nodes: int | None = None, processes_per_node: int | None = None) -> "RolePlacement":
        """This placement with ``role`` on ``pool`` (default: a pool named after it): ``devices`` processes on one
        node, or ``nodes`` x ``processes_per_node``; a pool already declared is shared. ConfigError on a role
        the job lacks, a new pool without its size, or a size other than the pool's."""
        if role not in self.roles:
            raise ConfigError(f"unknown role {role!r}; roles of this trainer: {sorted(self.roles)}")
        if role == "rollout" and pool is not None and pool == self.roles.get("actor"):
            raise ConfigError(f"register_placement('rollout', pool={pool!r}): that is the actor's pool, where the "
                              f"rollout sits by default; give it a pool of its own, or leave it with the actor")
        if devices is not None and (nodes is not None or processes_per_node is not None):
            raise ConfigError(f"register_placement({role!r}): give devices (one node) or nodes and "
                              f"processes_per_node, not both")
        pool = pool or role
        shape = None
        if devices is not None or processes_per_node is not None:
            value = devices if devices is not None else {"nodes": nodes or 1, "processes_per_node": processes_per_node}
            try:
                shape = pool_shape(pool, value, f"register_placement({role!r})")
            except PlacementError as exc:
                raise ConfigError(str(exc)) from None
        elif nodes is not None:
            raise ConfigError(f"register_placement({role!r}, nodes={nodes}): give processes_per_node too")
        shapes = dict(self.shapes)
        if pool in shapes:
            known = shapes[pool]
            if shape is not None and known.process_on_nodes != shape.process_on_nodes:
                if known.nodes == shape.nodes == 1:
                    raise ConfigError(f"pool {pool!r} has {known.world_size} processes, not {shape.world_size}")
                raise ConfigError(f"pool {pool!r} is {known}, not {shape}")
        elif shape is None:
            raise ConfigError(f"pool {pool!r} is new: give its devices (>= 1), or nodes and processes_per_node")
        else:
            shapes[pool] = shape
        roles = {**self.roles, role: pool}
        if role == "actor" and not self.rollout_apart:
            roles["rollout"] = pool
        return replace(self, shapes=shapes, roles=roles, rollout_apart=self.rollout_apart or role == "rollout")

    @property
    def pool_sizes(self) -> dict[str, int]:
        """Processes of each pool."""
        return {name: shape.world_size for name, shape in self.shapes.items()}

    def pool_of(self, role: str) -> PoolShape:
        return self.shapes[self.roles[role]]

    def used_shapes(self) -> list[PoolShape]:
        """The pools some role runs on, and "default"."""
        used = set(self.roles.values())
        return [shape for name, shape in self.shapes.items() if name in used or name == "default"]

    def into(self, config) -> Any:
        """``config`` (an RLConfig) with these pools in ``trainer.placement``: a pool's first role holds its shape,
        the others name that role; the rollout that follows the actor is left out."""
        placement, owner = {}, {}
        for role, pool in self.roles.items():
            shape = self.shapes[pool]
            if role == "rollout" and not self.rollout_apart:
                continue  # it follows the actor
            if pool != "default" and role in placeable_roles():  # the pool's first role holds it, the others share it
                if pool in owner:
                    placement[role] = owner[pool]
                else:
                    owner[pool] = role
                    placement[role] = {"nodes": shape.nodes, "processes_per_node": shape.processes_per_node}
        return replace(config, trainer=replace(config.trainer, placement=placement))
