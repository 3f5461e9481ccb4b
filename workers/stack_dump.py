"""A worker process's Python stacks on request: SIGUSR1 writes every thread's stack to a file
(``faulthandler``, which runs even while Python is blocked in a call), for the controller's hang reports
(``controller.runtime.hang_watch``) where py-spy is not installed."""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
from pathlib import Path

__all__ = ["STACK_DIR_ENV", "register_stack_dump", "stack_dump_path"]

STACK_DIR_ENV = "HYBRIDFLOW_STACK_DIR"  # where the dumps go (default: the temp dir)
_registered: list = []  # the open file the handler writes to (kept open for the process's life)


def stack_dump_path(pid: int) -> Path:
    return Path(os.environ.get(STACK_DIR_ENV) or tempfile.gettempdir()) / f"hybridflow_stacks_{pid}.txt"


def register_stack_dump() -> None:
    """SIGUSR1 appends every thread's Python stack to ``stack_dump_path(os.getpid())``; once per process, and
    only from the main thread (where signal handlers are set)."""
    if _registered or not hasattr(signal, "SIGUSR1"):
        return
    try:
        path = stack_dump_path(os.getpid())
        path.parent.mkdir(parents=True, exist_ok=True)
        stream = open(path, "a")  # noqa: SIM115 (the handler writes to it whenever the signal comes)
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True, chain=False)
        _registered.append(stream)
    except (OSError, ValueError, RuntimeError):  # not the main thread, or no writable temp dir: no dumps
        pass
