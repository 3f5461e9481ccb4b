"""HostSet: the processes of one resource pool, as the controller reaches them.

A backend (Ray, torchrun) implements one method that matters: ``submit``
sends an operation to the WorkerHost of one rank and returns a
``concurrent.futures.Future`` of its ``Reply``. Calls to one rank run in the
order they were submitted, which keeps collectives inside worker methods
lined up across ranks. A rank whose process is gone fails its futures with
``HostLostError``, now and for every later call.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from typing import Any, Callable

from controller.errors import HostLostError

__all__ = ["HostSet", "failed_future", "map_failure"]


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


class HostSet(abc.ABC):
    backend: str = ""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.global_ranks = list(range(world_size))  # torch.distributed rank of each pool rank
        self.lost: dict[int, str] = {}  # rank -> why its process is unreachable

    @abc.abstractmethod
    def _submit(self, rank: int, op: str, args: tuple) -> Future:
        """Run ``WorkerHost.<op>(*args)`` on ``rank``; the future resolves to its Reply."""

    def submit(self, rank: int, op: str, *args: Any) -> Future:
        if rank in self.lost:
            return failed_future(HostLostError(rank, f"its process was lost earlier ({self.lost[rank]})"))
        return self._submit(rank, op, args)

    def mark_lost(self, rank: int, detail: str) -> None:
        self.lost.setdefault(rank, detail)

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the processes (Ray) or release the ranks (torchrun)."""

    @abc.abstractmethod
    def pids(self) -> list[int]:
        """OS process id of each rank (for tests, fault injection and logs)."""
