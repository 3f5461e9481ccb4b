"""NodeWorker: the processes of a placed DataFlow node, each running the node's plain Python function.

The controller (``controller.dataflow.graph``) splits the node's input into one part per rank and sends each
part as a DataProto (lists travel as a non-tensor column, tensors as a batch column); the worker turns
it back into the value, calls the function, and sends the output the same way. While the function
runs, ``node_context()`` tells it where it is: its rank among the node's processes, their number, the
process group that joins them (the node's TP group under ``strategy="TP"``) and its device.
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hybridengine.device import use_device
from workers.base_worker import BaseWorker
from workers.data_proto import DataProto
from workers.dispatch import Dispatch
from workers.register import register

__all__ = ["NodeContext", "NodeWorker", "from_transport", "node_context", "to_transport"]

_VALUE = "value"


@dataclass(frozen=True)
class NodeContext:
    """Where a placed node's function runs."""

    name: str
    rank: int
    world_size: int
    process_group: Any  # torch.distributed group of the node's processes
    device: str  # as placed: "cpu:1", "cuda:0", ...
    pid: int


_CURRENT: contextvars.ContextVar[NodeContext | None] = contextvars.ContextVar("hybridflow_node", default=None)


def node_context() -> NodeContext:
    """The running node's context; RuntimeError outside a placed node's function (the driver)."""
    context = _CURRENT.get()
    if context is None:
        raise RuntimeError("node_context() is only set inside a placed DataFlow node's function "
                           "(@register_placement); this code runs in the driver")
    return context


def to_transport(value: Any) -> Any:
    """A list or tensor as a one-column DataProto (the project's zero-copy transport); anything else as is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return DataProto({_VALUE: value}, meta_info={"node_value": "tensor"})
    if isinstance(value, (list, tuple)):
        return DataProto(non_tensor_batch={_VALUE: list(value)}, meta_info={"node_value": type(value).__name__})
    return value


def from_transport(value: Any) -> Any:
    if not isinstance(value, DataProto) or "node_value" not in value.meta_info:
        return value
    kind = value.meta_info["node_value"]
    if kind == "tensor":
        return value.batch[_VALUE]
    items = list(value.non_tensor_batch[_VALUE]) if _VALUE in value.non_tensor_batch else []
    return tuple(items) if kind == "tuple" else items


class NodeWorker(BaseWorker):
    def __init__(self, name: str, func: Callable, devices: tuple[str, ...]) -> None:
        self.name, self.func = name, func
        self.placed_on = devices[self.rank]
        if self.placed_on.startswith("cuda"):
            use_device(int(self.placed_on.split(":")[1]))

    @register(Dispatch.ALL_TO_ALL)
    def run(self, args: tuple) -> Any:
        """The function on this rank's part of the inputs; its output ready for the transport."""
        context = NodeContext(self.name, self.rank, self.world_size, self.process_group, self.placed_on, os.getpid())
        token = _CURRENT.set(context)
        try:
            return to_transport(self.func(*(from_transport(a) for a in args)))
        finally:
            _CURRENT.reset(token)
