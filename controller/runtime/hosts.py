"""HostSet: the processes of one resource pool, as the controller reaches them.

A backend (Ray, torchrun) sends an operation to the WorkerHost of one rank
(``submit``: a ``concurrent.futures.Future`` of its ``Reply``) or to several
ranks at once (``submit_calls``: one ``RankCalls`` for them all, which a
backend may resolve in one wait; Ray does). Calls to one rank run in the
order they were submitted, which keeps collectives inside worker methods
lined up across ranks. A rank whose process is gone fails its calls with
``HostLostError``, now and for every later call.
"""

from __future__ import annotations

import abc
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, Callable, NamedTuple

from controller.errors import HostLostError
from workers.host import Reply

__all__ = ["HostSet", "RankCalls", "FutureCalls", "CallOutcome", "failed_future", "map_failure"]


def failed_future(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def map_failure(future: Future, translate: Callable[[BaseException], BaseException | None]) -> Future:
    """A future with ``future``'s outcome, its exception passed through ``translate`` (None: unchanged)."""
    out: Future = Future()

    def forward(done: Future) -> None:
        error = done.exception()
        if error is None:
            out.set_result(done.result())
        else:
            out.set_exception(translate(error) or error)

    future.add_done_callback(forward)
    return out


class CallOutcome(NamedTuple):
    """What waiting on a RankCalls gave: every reply, or the first transport failure, or the late ranks."""

    replies: dict[int, Reply]
    failure: tuple[int, BaseException] | None = None  # (rank, error) of a rank whose process is gone
    late: tuple[int, ...] = ()  # ranks that had not answered when the wait ran out


class RankCalls(abc.ABC):
    """One operation in flight on several ranks of a pool."""

    ranks: tuple[int, ...]

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether every rank has answered (or failed)."""

    @abc.abstractmethod
    def wait(self, timeout: float | None) -> CallOutcome:
        """Wait until every rank answered, one rank's process is gone, or ``timeout`` seconds passed."""


class FutureCalls(RankCalls):
    """Calls held as one ``concurrent.futures.Future`` per rank."""

    def __init__(self, futures: dict[int, Future]) -> None:
        self.futures = futures
        self.ranks = tuple(sorted(futures))

    def done(self) -> bool:
        return all(f.done() for f in self.futures.values())

    def wait(self, timeout: float | None) -> CallOutcome:
        # Return on the first failure: when one rank dies its peers may wait
        # in a collective forever, and the caller must not wait with them.
        done, pending = wait(self.futures.values(), timeout=timeout, return_when=FIRST_EXCEPTION)
        for rank, future in sorted(self.futures.items()):
            if future in done and future.exception() is not None:
                return CallOutcome({}, (rank, future.exception()))
        if pending:
            return CallOutcome({}, late=tuple(sorted(r for r, f in self.futures.items() if f in pending)))
        return CallOutcome({rank: f.result() for rank, f in self.futures.items()})


class HostSet(abc.ABC):
    backend: str = ""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.global_ranks = list(range(world_size))  # torch.distributed rank of each pool rank
        self.lost: dict[int, str] = {}  # rank -> why its process is unreachable
        self.rank_nodes: list[str] = []  # the node (address) of each rank, once the backend knows them

    @abc.abstractmethod
    def _submit(self, rank: int, op: str, args: tuple) -> Future:
        """Run ``WorkerHost.<op>(*args)`` on ``rank``; the future resolves to its Reply."""

    def submit(self, rank: int, op: str, *args: Any) -> Future:
        if rank in self.lost:
            return failed_future(HostLostError(rank, f"its process was lost earlier ({self.lost[rank]})"))
        return self._submit(rank, op, args)

    def submit_calls(self, op: str, calls: dict[int, tuple], private_inputs: bool = False) -> RankCalls:
        """Run ``WorkerHost.<op>(*calls[rank])`` on each rank given; one RankCalls for them all.

        ``private_inputs``: the method writes into its inputs, so no two ranks may share one copy of them
        (only a backend with shared-memory inputs has to act on it).
        """
        return FutureCalls({rank: self.submit(rank, op, *args) for rank, args in calls.items()})

    def node_of(self, rank: int) -> str | None:
        """The node ``rank`` runs on (its address), where the backend knows it."""
        return self.rank_nodes[rank] if rank < len(self.rank_nodes) else None

    def ranks_on(self, node: str) -> list[int]:
        return [rank for rank, where in enumerate(self.rank_nodes) if where == node]

    def describe_ranks(self, ranks) -> str:
        """``ranks`` by node for messages: "ranks [2, 3] on node 127.0.0.12 (which runs ranks [2, 3])"."""
        by_node: dict[str | None, list[int]] = {}
        for rank in sorted(ranks):
            by_node.setdefault(self.node_of(rank), []).append(rank)
        parts = []
        for node, members in by_node.items():
            label = f"rank {members[0]}" if len(members) == 1 else f"ranks {members}"
            parts.append(label if node is None else f"{label} on node {node} (which runs ranks {self.ranks_on(node)})")
        return "; ".join(parts)

    def mark_lost(self, rank: int, detail: str) -> None:
        self.lost.setdefault(rank, detail)

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the processes (Ray) or release the ranks (torchrun)."""

    @abc.abstractmethod
    def pids(self) -> list[int]:
        """OS process id of each rank (for tests, fault injection and logs)."""
