"""Placement across nodes: which pools a job needs, and whether a cluster can hold them.

A pool is ``nodes`` x ``processes_per_node`` worker processes, one node per
entry of its ``process_on_nodes`` list (what ``ResourcePool`` takes). The
job's default pool is ``trainer.nnodes`` x ``trainer.nproc``; each role in
``trainer.placement`` (or given to ``RLTrainer.register_placement``) adds a
pool of its own, and roles named on one pool share its processes.

``fit_pools`` answers, before any process starts, whether the pools fit a
cluster's nodes (each process takes ``cpus_per_process`` CPUs and, on a GPU
cluster, one GPU; the processes of one pool entry share one node, and the
entries of one pool go to different nodes, as Ray's STRICT_SPREAD places
them). It places the pools in the order they are created, each entry on
the node with the most room left, and names what the cluster has when one
does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PoolShape", "ClusterNode", "fit_pools", "pool_shape", "describe_cluster", "PlacementError"]


class PlacementError(ValueError):
    """The pools do not fit the cluster; the message names what the cluster has."""


@dataclass(frozen=True)
class PoolShape:
    name: str
    nodes: int
    processes_per_node: int

    def __post_init__(self) -> None:
        for field in ("nodes", "processes_per_node"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlacementError(f"pool {self.name!r}: {field} must be a positive integer, got {value!r}")

    @property
    def process_on_nodes(self) -> list[int]:
        return [self.processes_per_node] * self.nodes

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    def __str__(self) -> str:
        return f"{self.nodes} node(s) x {self.processes_per_node} process(es)"


@dataclass(frozen=True)
class ClusterNode:
    address: str
    cpus: float
    gpus: float = 0.0

    def __str__(self) -> str:
        return f"{self.address} ({self.cpus:g} CPU, {self.gpus:g} GPU)"


def pool_shape(name: str, value: Any, where: str) -> PoolShape:
    """A placement entry as a PoolShape: an int (processes on one node) or {nodes, processes_per_node}."""
    if isinstance(value, PoolShape):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return PoolShape(name, 1, value) if value >= 1 else _bad(where, value)
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"nodes", "processes_per_node"})
        if unknown or "processes_per_node" not in value:
            _bad(where, value)
        try:
            return PoolShape(name, value.get("nodes", 1), value["processes_per_node"])
        except PlacementError:
            _bad(where, value)
    _bad(where, value)


def _bad(where: str, value: Any):
    raise PlacementError(f"{where} must be a positive number of processes (on one node) or "
                         f"{{nodes: N, processes_per_node: P}}, got {value!r}")


def describe_cluster(nodes: list[ClusterNode]) -> str:
    return f"{len(nodes)} node(s): " + ", ".join(map(str, nodes)) if nodes else "no live nodes"


def fit_pools(pools: list[PoolShape | tuple[str, list[int]]], cluster: list[ClusterNode],
              cpus_per_process: float = 1.0, use_gpu: bool | None = None) -> dict[str, list[str]]:
    """The node address of each pool entry; PlacementError naming the cluster when the pools do not fit.

    A pool is a PoolShape or ``(name, process_on_nodes)``. ``use_gpu`` None:
    one GPU per process when the cluster has GPUs.
    """
    if use_gpu is None:
        use_gpu = any(node.gpus > 0 for node in cluster)
    demands = [(p.name, p.process_on_nodes) if isinstance(p, PoolShape) else (p[0], list(p[1])) for p in pools]
    free = {node.address: [node.cpus, node.gpus] for node in cluster}
    placed: dict[str, list[str]] = {}
    for name, entries in demands:  # in the order the pools are created, as Ray places them
        chosen: list[str] = []
        for processes in sorted(entries, reverse=True):
            need_cpu, need_gpu = processes * cpus_per_process, processes if use_gpu else 0
            roomy = [a for a, (cpu, gpu) in free.items() if a not in chosen and cpu >= need_cpu and gpu >= need_gpu]
            if not roomy:
                per_node = f"{need_cpu:g} CPU" + (f" and {need_gpu} GPU" if use_gpu else "")
                after = f" besides pool(s) {sorted(placed)}" if placed else ""
                raise PlacementError(
                    f"pool {name!r} ({_entries(entries)}) needs {len(entries)} different node(s), one with "
                    f"{per_node} free for {processes} process(es){after}, and the cluster has no such node left: "
                    f"it has {describe_cluster(cluster)}")
            address = max(roomy, key=lambda a: (free[a][1], free[a][0]))
            free[address][0] -= need_cpu
            free[address][1] -= need_gpu
            chosen.append(address)
        placed[name] = chosen
    return placed


def _entries(entries: list[int]) -> str:
    if len(set(entries)) == 1:
        return f"{len(entries)} node(s) x {entries[0]} process(es)"
    return f"processes per node {entries}"
