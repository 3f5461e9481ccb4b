"""The torchrun backend: the controller program runs on rank 0, which is also worker 0.

Every rank runs the same program. When it creates its first ResourcePool,
each rank joins torch.distributed (gloo on CPU, NCCL on GPU) and the ranks
open control sockets to rank 0. Ranks other than 0 then stay inside
``serve_forever``: they run whatever rank 0 sends and exit when rank 0's
program ends, so code after the first pool is created runs on rank 0 alone.

Rank 0 runs its own worker calls on one dedicated thread, in submission
order, so the controller thread is free to send work to the other ranks
and a call can return a future while rank 0's share is still running.
"""

from __future__ import annotations

import atexit
import collections
import os
import queue
import select
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from controller.errors import HostLostError
from controller.runtime.hosts import HostSet, map_failure
from controller.runtime.process_exit import exit_process
from controller.runtime.wire import recv_message, send_message
from workers.host import Reply, WorkerHost

__all__ = ["TorchrunRuntime", "TorchrunHostSet", "under_torchrun"]

_SHUTDOWN = "__shutdown__"


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("HYBRIDFLOW_BACKEND") == "torchrun"


class _RemoteRank:
    """Rank 0's end of the control socket to one other rank."""

    def __init__(self, rank: int, conn: socket.socket, on_lost) -> None:
        self.rank = rank
        self.conn = conn
        self.pending: collections.deque[Future] = collections.deque()
        self.lock = threading.Lock()
        self.lost: str | None = None
        self.on_lost = on_lost
        threading.Thread(target=self._read_replies, name=f"hybridflow-rank{rank}-reader", daemon=True).start()

    def submit(self, op: str, args: tuple) -> Future:
        future: Future = Future()
        with self.lock:
            if self.lost is not None:
                future.set_exception(HostLostError(self.rank, self.lost))
                return future
            self.pending.append(future)
            try:
                send_message(self.conn, (op, args))
            except OSError as exc:
                self._fail_all(f"control connection broke while sending ({exc})")
        return future

    def _read_replies(self) -> None:
        while True:
            try:
                reply = recv_message(self.conn)
            except (OSError, EOFError, ConnectionError) as exc:
                with self.lock:
                    self._fail_all(f"its process exited or the connection dropped ({exc})")
                return
            with self.lock:
                future = self.pending.popleft() if self.pending else None
            if future is not None:
                future.set_result(reply)

    def _fail_all(self, detail: str) -> None:
        if self.lost is None:
            self.lost = detail
            self.on_lost(self.rank, detail)
        while self.pending:
            self.pending.popleft().set_exception(HostLostError(self.rank, detail))

    def close(self) -> None:
        with self.lock:
            if self.lost is None:
                try:
                    send_message(self.conn, (_SHUTDOWN, ()))
                except OSError:
                    pass
                self.lost = "the controller shut the group down"
        try:
            self.conn.close()
        except OSError:
            pass


class _LocalWorkerThread:
    """Runs rank 0's share of each call in submission order on one daemon thread.

    A daemon thread, not a ThreadPoolExecutor: when the controller program
    ends (or fails because a peer died) it must not wait for a call that
    is still running here.
    """

    def __init__(self, run) -> None:
        self.run = run
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = False
        threading.Thread(target=self._loop, name="hybridflow-rank0-worker", daemon=True).start()

    def submit(self, op: str, args: tuple) -> Future:
        future: Future = Future()
        self.queue.put((future, op, args))
        return future

    def _loop(self) -> None:
        while True:
            future, op, args = self.queue.get()
            self.busy = True
            try:
                future.set_result(self.run(op, args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            finally:
                self.busy = self.queue.qsize() > 0


class TorchrunRuntime:
    """One per process: the torchrun world, its control sockets and rank allocation."""

    _instance: "TorchrunRuntime | None" = None

    @classmethod
    def get(cls, dist_timeout_s: float = 1800.0, connect_timeout_s: float = 120.0) -> "TorchrunRuntime":
        if cls._instance is None:
            cls._instance = cls(dist_timeout_s, connect_timeout_s)
        return cls._instance

    def __init__(self, dist_timeout_s: float, connect_timeout_s: float) -> None:
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise RuntimeError(f"the torchrun backend needs {name} in the environment; launch with torchrun")
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.host = WorkerHost(self.rank, self.world_size, int(os.environ.get("LOCAL_RANK", "0")))
        reply = self.host.init_distributed(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), dist_timeout_s)
        if not reply.ok:
            raise RuntimeError(f"rank {self.rank} could not join torch.distributed:\n{reply.remote_traceback}")
        self.next_rank = 0
        self.lost_listeners: list = []
        if self.rank == 0:
            self._accept_ranks(connect_timeout_s)
        else:
            self._connect_to_rank0(connect_timeout_s)

    # ------------------------------------------------------------ rendezvous
    def _accept_ranks(self, timeout_s: float) -> None:
        master = os.environ["MASTER_ADDR"]
        bind_address = "127.0.0.1" if master in ("127.0.0.1", "localhost") else "0.0.0.0"
        listener = socket.create_server((bind_address, 0))
        listener.settimeout(timeout_s)
        dist.broadcast_object_list([(master, listener.getsockname()[1])], src=0)
        conns: dict[int, socket.socket] = {}
        self.node_labels = {0: _node_label()}
        while len(conns) < self.world_size - 1:
            conn, _ = listener.accept()
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rank, node = recv_message(conn)
            conns[rank], self.node_labels[rank] = conn, node
        listener.close()
        self.remotes = {r: _RemoteRank(r, c, self._on_lost) for r, c in conns.items()}
        self.local = _LocalWorkerThread(lambda op, args: getattr(self.host, op)(*args))
        atexit.register(self.shutdown)

    def _connect_to_rank0(self, timeout_s: float) -> None:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        self.conn = socket.create_connection(box[0], timeout=timeout_s)
        self.conn.settimeout(None)
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_message(self.conn, (self.rank, _node_label()))

    def _on_lost(self, rank: int, detail: str) -> None:
        for listener in list(self.lost_listeners):
            listener(rank, detail)

    # ------------------------------------------------------------ rank 0 side
    def allocate(self, count: int) -> list[int]:
        """The next ``count`` unused ranks of the torchrun world, in order."""
        free = self.world_size - self.next_rank
        if count > free:
            raise ValueError(
                f"resource pool asks for {count} processes but torchrun started WORLD_SIZE={self.world_size} "
                f"and {self.next_rank} are already in other pools ({free} free); "
                f"launch with --nproc-per-node so the pools fit"
            )
        ranks = list(range(self.next_rank, self.next_rank + count))
        self.next_rank += count
        return ranks

    def submit(self, rank: int, op: str, args: tuple) -> Future:
        if rank == 0:
            return self.local.submit(op, args)
        return self.remotes[rank].submit(op, args)

    def shutdown(self) -> None:
        if self.rank != 0 or getattr(self, "_closed", False):
            return
        self._closed = True
        for remote in self.remotes.values():
            remote.close()
        if not self.local.busy:
            self.host.shutdown()

    # ------------------------------------------------------- other ranks' side
    def serve_forever(self) -> None:
        """Run rank 0's requests until it shuts down or goes away; then exit the process."""
        self.busy = False
        threading.Thread(target=self._exit_if_controller_leaves, name="hybridflow-controller-watch", daemon=True).start()
        while True:
            try:
                op, args = recv_message(self.conn)
            except (OSError, EOFError, ConnectionError):
                break
            if op == _SHUTDOWN:
                break
            self.busy = True
            try:
                reply = getattr(self.host, op)(*args)
            except Exception as exc:  # noqa: BLE001 - a host op itself failed
                reply = Reply(ok=False, error_type=type(exc).__name__, remote_traceback=traceback.format_exc())
            self.busy = False
            try:
                send_message(self.conn, reply)
            except OSError:
                break
        self.host.shutdown()
        exit_process(0)

    def _exit_if_controller_leaves(self) -> None:
        """While a call runs, watch rank 0's connection: if it closes, nobody waits for the result; leave.

        (A call may be a collective with ranks on a node that is gone, which would
        otherwise hold this process, and its launcher, until the collective times out.)
        """
        while True:
            readable, _, _ = select.select([self.conn], [], [], 1.0)
            if readable and self.busy:
                try:
                    closed = not self.conn.recv(1, socket.MSG_PEEK)
                except OSError:
                    closed = True
                if closed and self.busy:
                    print(f"[hybridflow] rank {self.rank}: the controller (rank 0) went away during a call; exiting",
                          file=sys.stderr, flush=True)
                    os._exit(1)
            if readable:
                time.sleep(0.5)  # a request waits to be read: look again later


def _node_label() -> str:
    """This process's node for messages: torchrun's node rank and the node's address (or host name)."""
    host = os.environ.get("HYBRIDFLOW_NODE_IP") or socket.gethostname()
    return f"{os.environ.get('GROUP_RANK', '0')} ({host})"


class TorchrunHostSet(HostSet):
    """A slice of the torchrun world's ranks, used as one resource pool."""

    backend = "torchrun"

    def __init__(self, runtime: TorchrunRuntime, ranks: list[int]) -> None:
        super().__init__(len(ranks))
        self.runtime = runtime
        self.global_ranks = list(ranks)
        self.rank_nodes = [runtime.node_labels[r] for r in ranks]
        runtime.lost_listeners.append(self._on_lost)

    def _on_lost(self, global_rank: int, detail: str) -> None:
        if global_rank in self.global_ranks:
            self.mark_lost(self.global_ranks.index(global_rank), detail)

    def _submit(self, rank: int, op: str, args: tuple) -> Future:
        return _relabel(self.runtime.submit(self.global_ranks[rank], op, args), self.global_ranks[rank], rank)

    def submit_world(self, op: str, *args: Any) -> list[Future]:
        """An op that every process of the torchrun world must run (new process groups)."""
        return [self.runtime.submit(r, op, args) for r in range(self.runtime.world_size)]

    def pids(self) -> list[int]:
        return [self.runtime.submit(r, "pid", ()).result() for r in self.global_ranks]

    def shutdown(self) -> None:
        """The ranks stay up until the controller program ends; nothing to stop per pool."""


def _relabel(future: Future, global_rank: int, pool_rank: int) -> Future:
    """Report a lost host by its rank in the pool, the rank users see."""
    if global_rank == pool_rank:
        return future
    return map_failure(
        future, lambda error: HostLostError(pool_rank, error.detail) if isinstance(error, HostLostError) else None
    )
