"""WorkerHost: the per-process object that holds a process's workers and runs calls.

One host lives in every process of a resource pool, whatever launched the
process (a Ray actor, a torchrun rank). It joins torch.distributed, builds
the workers that the controller asks for (several roles may share one
process: that is colocation), and runs their methods. It never raises into
the transport: every outcome comes back as a ``Reply``, so the controller
can say which rank and which method failed and show the remote traceback.
"""

from __future__ import annotations

import datetime
import os
import sys
import socket
import traceback
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hybridengine.device import device_for_local_rank, dist_backend
from hybridengine.parallel.layout import ParallelLayout
from workers.base_worker import BaseWorker, WorkerContext, bind_context, unbind_context

__all__ = ["WorkerHost", "Reply", "free_port", "node_ip_address"]


@dataclass
class Reply:
    ok: bool
    value: Any = None
    error_type: str = ""
    remote_traceback: str = ""
    layout: ParallelLayout | None = None


def free_port(host: str = "") -> int:
    """A port nothing listens on; ``host`` "" checks every interface, so no listener bound to one address
    (another loopback address, say) holds it either."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def node_ip_address() -> str:
    """The address other nodes reach this one on: HYBRIDFLOW_NODE_IP, else loopback (one node)."""
    return os.environ.get("HYBRIDFLOW_NODE_IP", "127.0.0.1")


class WorkerHost:
    """The workers of one process, and the process's torch.distributed membership."""

    def __init__(self, rank: int, world_size: int, local_rank: int = 0) -> None:
        from workers.console import configure_console
        from workers.stack_dump import register_stack_dump

        configure_console()  # this process's share of the run's console choice (HYBRIDFLOW_VERBOSE)
        register_stack_dump()  # SIGUSR1: every thread's stack to a file, for a hang's report
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device_for_local_rank(local_rank)
        self.workers: dict[str, BaseWorker] = {}  # role -> worker
        self.process_groups: dict[str, Any] = {}

    # ----------------------------------------------------------- lifecycle
    def address(self) -> tuple[str, int, int]:
        """(node address, a free port on it, pid): rank 0's becomes the rendezvous."""
        return node_ip_address(), free_port(), os.getpid()

    def init_distributed(self, master_addr: str, master_port: int, timeout_s: float) -> Reply:
        """Join the pool's torch.distributed world (gloo on CPU, NCCL on GPU)."""
        return self._guarded(self._init_distributed, master_addr, master_port, timeout_s)

    def _init_distributed(self, master_addr: str, master_port: int, timeout_s: float) -> None:
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
        )
        if not dist.is_initialized():
            dist.init_process_group(
                backend=dist_backend(),
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )

    def new_process_group(self, key: str, ranks: list[int]) -> Reply:
        """Collective over the whole world: every process must call it, members or not."""

        def build() -> None:
            if list(ranks) == list(range(dist.get_world_size())):
                self.process_groups[key] = dist.group.WORLD
            else:
                group = dist.new_group(ranks=list(ranks))
                if self.rank in ranks:
                    self.process_groups[key] = group

        return self._guarded(build)

    def shutdown(self) -> None:
        # Newest first: a worker may hold on to an older peer (the rollout to the actor).
        for role, worker in reversed(list(self.workers.items())):
            try:
                worker.close()
            except Exception as exc:  # noqa: BLE001 - shutting down; the others still get closed
                print(f"[rank {self.rank}] closing the {role!r} worker failed: {exc!r}", file=sys.stderr)
        self.workers.clear()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------- workers
    def create_worker(
        self,
        role: str,
        worker_cls: type,
        args: tuple,
        kwargs: dict,
        group_rank: int,
        group_ranks: tuple[int, ...],
        process_group_key: str | None,
    ) -> Reply:
        if role in self.workers:
            return Reply(
                ok=False,
                error_type="ValueError",
                remote_traceback=f"role {role!r} already exists in this process; roles here: {sorted(self.workers)}",
            )
        context = WorkerContext(
            rank=group_rank,
            world_size=len(group_ranks),
            local_rank=self.local_rank,
            device=self.device,
            role=role,
            process_group=self.process_groups.get(process_group_key) if process_group_key else None,
            global_ranks=tuple(group_ranks),
            peers=self.workers,
        )

        def build() -> None:
            token = bind_context(context)
            try:
                worker = worker_cls(*args, **kwargs)
            finally:
                unbind_context(token)
            self.workers[role] = worker

        reply = self._guarded(build)
        if reply.ok:
            reply.layout = self.workers[role].layout
        return reply

    def execute(self, role: str, method: str, args: tuple, kwargs: dict) -> Reply:
        worker = self.workers.get(role)
        if worker is None:
            return Reply(ok=False, error_type="KeyError", remote_traceback=f"no worker with role {role!r} here")
        reply = self._guarded(lambda: getattr(worker, method)(*args, **kwargs))
        reply.layout = worker.layout
        return reply

    @staticmethod
    def _guarded(fn, *args: Any, **kwargs: Any) -> Reply:
        try:
            return Reply(ok=True, value=fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the controller
            return Reply(ok=False, error_type=type(exc).__name__, remote_traceback=traceback.format_exc())

    def pid(self) -> int:
        return os.getpid()
