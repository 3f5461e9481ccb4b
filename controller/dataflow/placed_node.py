"""A placed DataFlow node: its worker group, and how its input is split and its outputs gathered.

``PlacedNode(declaration, func)`` starts nothing until first called; then it starts one process per
declared device (a Ray pool: on this machine, or across a cluster at ``ray_address``) holding a
``workers.node_worker.NodeWorker``. Each call splits the inputs by the node's protocol, runs the
function on every process, and gathers the outputs. ``split_value`` and ``gather_values`` are the pure
rules, tested without processes; ``check_machine_devices`` refuses a device the machine lacks before
any process starts.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from controller.dataflow.declarations import NodeDeclaration
from controller.runtime.resource_pool import ResourcePool
from controller.runtime.worker_group import WorkerGroup
from hybridengine.device import accelerator_count
from workers.data_proto import DataProto
from workers.node_worker import NodeWorker, from_transport, to_transport

__all__ = ["PlacedNode", "check_machine_devices", "gather_values", "split_value"]


def _bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, sizes differing by at most one, earlier parts larger."""
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + base + (part < extra)
        bounds.append((start, end))
        start = end
    return bounds


def split_value(value: Any, parts: int, mode: str) -> list[Any]:
    """``value`` for each of ``parts`` processes: ``broadcast`` gives it whole to each; ``chunk`` cuts a
    list, tuple, tensor, numpy array or DataProto into contiguous parts along its first dimension (other
    values go whole to each: a setting, not data)."""
    if mode == "broadcast":
        return [value] * parts
    if isinstance(value, DataProto):
        return [value[start:end] for start, end in _bounds(len(value), parts)]
    if isinstance(value, (list, tuple, np.ndarray)) or (isinstance(value, torch.Tensor) and value.dim() > 0):
        return [value[start:end] for start, end in _bounds(len(value), parts)]
    return [value] * parts


def gather_values(outputs: list[Any], mode: str) -> Any:
    """One output from every process's: ``rank0``'s, ``all`` of them as a list, or ``concat``: lists,
    tuples, tensors, numpy arrays and DataProtos joined in rank order (anything else: the list)."""
    if mode == "rank0":
        return outputs[0]
    if mode == "all":
        return list(outputs)
    first = outputs[0]
    if all(isinstance(o, DataProto) for o in outputs):
        return DataProto.concat(outputs)
    if all(isinstance(o, torch.Tensor) and o.dim() > 0 for o in outputs):
        return torch.cat(outputs)
    if all(isinstance(o, np.ndarray) for o in outputs):
        return np.concatenate(outputs)
    if all(isinstance(o, (list, tuple)) for o in outputs):
        joined = [item for o in outputs for item in o]
        return tuple(joined) if isinstance(first, tuple) else joined
    return list(outputs)


def check_machine_devices(declarations: list[NodeDeclaration], gpus: int | None = None) -> None:
    """ValueError naming a ``cuda:N`` this machine does not have, and the devices it has."""
    gpus = accelerator_count() if gpus is None else gpus
    has = ["cpu"] + [f"cuda:{i}" for i in range(gpus)]
    for declaration in declarations:
        for device in declaration.devices or ():
            if device.startswith("cuda:") and int(device.split(":")[1]) >= gpus:
                raise ValueError(f"node {declaration.name!r} is placed on {device}, which this machine does not have; "
                                 f"it has {has} (CPU processes: 'cpu' or 'cpu:N')")


class PlacedNode:
    """Callable like the node's function; runs it on the node's own processes."""

    def __init__(self, declaration: NodeDeclaration, func: Callable, backend: str = "ray",
                 ray_address: str | None = None) -> None:
        self.declaration, self.func = declaration, func
        self.backend, self.ray_address = backend, ray_address
        self.pool: ResourcePool | None = None
        self.group: WorkerGroup | None = None

    def start(self) -> None:
        if self.group is not None:
            return
        devices = self.declaration.devices
        # cuda:N is chosen by the worker itself (torch.cuda.set_device), so Ray must not narrow the GPUs it sees.
        self.pool = ResourcePool([len(devices)], backend=self.backend, use_gpu=False, ray_address=self.ray_address,
                                 name=f"node-{self.declaration.name}")
        self.group = WorkerGroup(self.pool, NodeWorker, role=self.declaration.name,
                                 kwargs={"name": self.declaration.name, "func": self.func, "devices": devices})

    def __call__(self, *args: Any) -> Any:
        self.start()
        split, gather = self.declaration.protocol
        parts = len(self.declaration.devices)
        per_arg = [split_value(a, parts, split) for a in args]
        per_rank = [tuple(to_transport(values[rank]) for values in per_arg) for rank in range(parts)]
        outputs = self.group.run(per_rank)
        return gather_values([from_transport(o) for o in outputs], gather)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        self.pool = self.group = None
