"""Automatic restart: which failures a job restarts after, and the bound that stops a crash loop.

``trainer.max_restarts: N`` lets a job restart itself after a worker or node dies or a call hangs:
the groups are torn down, started again on the nodes still healthy, and the run resumes from its
newest complete checkpoint. At most N restarts fit in any ``trainer.restart_window_s``; the failure
after them stops the job (``CrashLoopError``, exit 3) listing every failure in the window.

    budget = RestartBudget(max_restarts=2, window_s=3600, log_path=run_dir / "restarts.jsonl")
    try:
        ...
    except Exception as error:
        if not restartable(error):
            raise
        number = budget.admit(describe(error))   # raises CrashLoopError when the budget is spent

A restart is counted, said in the console and appended to ``run_dir/restarts.jsonl`` (its time, the
cause, the step it resumed from and where). What is restarted after: a worker that died or whose node
did (``WorkerDiedError``), a hang (``HangError``), ranks that never answered (``CallTimeoutError``), a
collective that failed because a peer went away (a ``RemoteWorkerError`` of torch.distributed's own
error types). A worker's Python exception, a bad config, a full disk or non-finite steps are not: they
would fail the same way again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from controller.errors import CallTimeoutError, RemoteWorkerError, TrainingStoppedError, WorkerDiedError
from controller.runtime.hang_watch import HangError

__all__ = ["CrashLoopError", "Failure", "RestartBudget", "describe", "restartable", "RESTART_ENV", "restart_fields"]

# Under torchrun, the launching command's restart count, in the ranks' environment (they then resume).
RESTART_ENV = "HYBRIDFLOW_RESTART"

# torch.distributed's errors for a collective whose peer went away (gloo: the connection closed; NCCL: the
# communicator aborted): the surviving ranks' side of a dead rank.
PEER_LOST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")
PEER_LOST_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


class CrashLoopError(TrainingStoppedError):
    """More failures within ``trainer.restart_window_s`` than ``trainer.max_restarts`` allows; lists them."""


def restartable(error: BaseException) -> bool:
    """Whether a restart can get past ``error``: a lost process or node, a hang, a peer's broken collective."""
    if isinstance(error, (WorkerDiedError, HangError, CallTimeoutError)):
        return True
    if isinstance(error, RemoteWorkerError):
        return error.error_type in PEER_LOST_ERRORS or any(text in error.remote_traceback for text in PEER_LOST_TEXT)
    return False


def describe(error: BaseException) -> str:
    """The first line of the error, with its type: what a restart's record and a crash loop's list show."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0].rstrip(':;, ') if text else ''}"


def restart_fields(restarts: int, data_parallel: int) -> dict[str, float]:
    """What the metrics logger adds to every record of a restarted job (none before its first restart)."""
    return {"job/restarts": float(restarts), "job/data_parallel": float(data_parallel)} if restarts else {}


@dataclass
class Failure:
    at: float  # time.time()
    cause: str
    restarted: bool = False
    details: dict = field(default_factory=dict)  # where the restart resumed: step, nodes, data-parallel sizes

    def line(self) -> str:
        return f"{time.strftime('%H:%M:%S', time.localtime(self.at))} {self.cause}"


class RestartBudget:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds; ``admit`` counts each failure."""

    def __init__(self, max_restarts: int, window_s: float, log_path: str | Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if max_restarts < 0 or not window_s > 0:
            raise ValueError(f"max_restarts must be >= 0 and window_s > 0, got {max_restarts} and {window_s}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.log_path = Path(log_path) if log_path is not None else None
        self.clock = clock
        self.failures: list[Failure] = []

    @property
    def restarts(self) -> int:
        """Restarts so far, in all."""
        return sum(f.restarted for f in self.failures)

    def admit(self, cause: str) -> int:
        """Count a failure; returns the restart's number (1, 2, ...) or raises ``CrashLoopError`` when
        ``max_restarts`` restarts already happened within the window."""
        now = self.clock()
        failure = Failure(now, cause)
        self.failures.append(failure)
        recent = [f for f in self.failures if f.restarted and now - f.at < self.window_s]
        if len(recent) >= self.max_restarts:
            window = [f for f in self.failures if now - f.at < self.window_s]
            listed = "; ".join(f"[{i}] {f.line()}" for i, f in enumerate(window, 1))
            if self.max_restarts == 0:
                raise CrashLoopError(f"{cause} (trainer.max_restarts=0: no restarts)")
            raise CrashLoopError(f"{len(window)} failures within trainer.restart_window_s={self.window_s:g} s, "
                                 f"more than trainer.max_restarts={self.max_restarts} restarts allow: {listed}")
        failure.restarted = True
        return self.restarts

    def record(self, **details) -> None:
        """Where the newest restart resumed (step, nodes, data-parallel sizes): kept with it and appended to
        ``log_path`` as one JSON line."""
        failure = self.failures[-1]
        failure.details.update(details)
        if self.log_path is not None:
            with open(self.log_path, "a", encoding="utf-8") as out:
                out.write(json.dumps({"restart": self.restarts, **asdict(failure)}) + "\n")
