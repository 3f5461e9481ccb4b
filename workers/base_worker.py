"""BaseWorker: one process's member of a worker group.

Subclass it, mark public methods with ``@register(Dispatch.X)``, and the
controller can call them on the whole group. The process that hosts the
worker fills in its rank, world size, device and process group before
``__init__`` runs, so a subclass's ``__init__`` can use them and need not
call ``super().__init__()``.
"""

from __future__ import annotations

import contextvars
import os
import resource
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridengine.device import peak_memory
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.plan import GenerationMesh
from workers.dispatch import Dispatch
from workers.register import register

__all__ = ["BaseWorker", "WorkerContext"]


@dataclass
class WorkerContext:
    """Where a worker lives: set by its host process, read through BaseWorker's properties."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    role: str
    process_group: Any = None  # torch.distributed.ProcessGroup of the worker's group
    global_ranks: tuple[int, ...] = ()  # process-group ranks of group ranks 0..n-1
    peers: dict[str, Any] = field(default_factory=dict)  # role -> colocated worker in this process


_CONTEXT: contextvars.ContextVar[WorkerContext | None] = contextvars.ContextVar("hybridflow_worker_context", default=None)


def bind_context(context: WorkerContext) -> contextvars.Token:
    """Make ``context`` the one the next BaseWorker constructed in this thread picks up."""
    return _CONTEXT.set(context)


def unbind_context(token: contextvars.Token) -> None:
    _CONTEXT.reset(token)


class BaseWorker:
    """Base class of every worker (actor, critic, rollout, user-defined)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "BaseWorker":
        worker = super().__new__(cls)
        context = _CONTEXT.get()
        if context is None:
            # Built outside a worker group (a unit test, a notebook): a group of one.
            context = WorkerContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), role=cls.__name__)
        worker._context = context
        worker._layout = None
        return worker

    # ------------------------------------------------------------- identity
    @property
    def rank(self) -> int:
        return self._context.rank

    @property
    def world_size(self) -> int:
        return self._context.world_size

    @property
    def local_rank(self) -> int:
        return self._context.local_rank

    @property
    def device(self) -> torch.device:
        return self._context.device

    @property
    def role(self) -> str:
        return self._context.role

    @property
    def process_group(self) -> Any:
        """The torch.distributed group of exactly this worker group's ranks."""
        return self._context.process_group

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """Ranks in the process's default torch.distributed group of group ranks 0..world_size-1."""
        return self._context.global_ranks

    # --------------------------------------------------------------- layout
    @property
    def layout(self) -> ParallelLayout | GenerationMesh | None:
        """The worker's TP/PP/DP layout once it has built a model; None before."""
        return self._layout

    def set_layout(self, layout: ParallelLayout | GenerationMesh) -> None:
        """The grid that MESH_COMPUTE_PROTO splits this group's batches over."""
        if layout.world_size != self.world_size:
            raise ValueError(
                f"layout {layout} covers {layout.world_size} ranks but this worker group has {self.world_size}"
            )
        self._layout = layout

    def close(self) -> None:
        """Release what the worker holds (engines, files); the host calls it once, at shutdown.

        The process group is still alive while it runs. The default does nothing.
        """

    # ----------------------------------------------------------- colocation
    def peer(self, role: str) -> "BaseWorker":
        """The worker of another role that shares this process (colocated groups)."""
        try:
            return self._context.peers[role]
        except KeyError:
            known = sorted(r for r in self._context.peers if r != self.role)
            raise KeyError(f"no colocated worker with role {role!r} in this process; colocated roles: {known}") from None

    # ------------------------------------------------------- group methods
    @register(Dispatch.ONE_TO_ALL)
    def worker_info(self) -> dict[str, Any]:
        """Where each rank runs: for logs, tests and benchmarks."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "device": str(self.device),
            "pid": os.getpid(),
            "role": self.role,
            "layout": str(self.layout) if self.layout else None,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_memory_gb": peak_memory() / 2**30,  # the device's peak (GPU allocator, or CPU resident set)
        }
