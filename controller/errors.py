"""Errors the controller raises: a configuration that cannot run, and what a worker-group call can raise."""

from __future__ import annotations

__all__ = ["ConfigError", "WorkerGroupError", "RemoteWorkerError", "WorkerDiedError", "CallTimeoutError", "HostLostError",
           "NonFiniteTrainingError", "TrainingStoppedError"]


class ConfigError(ValueError):
    """The configuration cannot run; the message lists every problem found."""


class TrainingStoppedError(RuntimeError):
    """The run stopped itself for a reason it names (the CLI prints it and exits 3); its last complete
    checkpoint is intact."""


class NonFiniteTrainingError(TrainingStoppedError):
    """``trainer.max_bad_steps`` steps in a row skipped their optimizer steps (a NaN or Inf loss or gradient)."""


class WorkerGroupError(RuntimeError):
    """Base class: something went wrong on the workers' side of a group call."""


class RemoteWorkerError(WorkerGroupError):
    """A worker method raised; carries the rank, the method and the remote traceback."""

    def __init__(self, rank: int, method: str, error_type: str, remote_traceback: str) -> None:
        self.rank = rank
        self.method = method
        self.error_type = error_type
        self.remote_traceback = remote_traceback
        super().__init__(f"{error_type} on rank {rank} in {method!r}; remote traceback:\n{remote_traceback}")


class WorkerDiedError(WorkerGroupError):
    """A worker process is gone (killed, crashed, lost its node) while a call was pending."""

    def __init__(self, rank: int, method: str, detail: str) -> None:
        self.rank = rank
        self.method = method
        super().__init__(f"worker rank {rank} died during {method!r}: {detail}")


class CallTimeoutError(WorkerGroupError):
    """Some ranks did not answer within the call's time limit."""

    def __init__(self, ranks: list[int], method: str, timeout_s: float, where: str | None = None) -> None:
        self.ranks = ranks
        self.method = method
        located = f" ({where})" if where and "node" in where else ""
        super().__init__(f"ranks {ranks} did not answer {method!r} within {timeout_s:g} s{located}")


class HostLostError(ConnectionError):
    """Transport-level: the process behind a rank is unreachable. Groups turn it into WorkerDiedError."""

    def __init__(self, rank: int, detail: str) -> None:
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank}: {detail}")
