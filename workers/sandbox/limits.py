"""SandboxLimits: what one sandboxed program may use, checked when it is built.

::

    SandboxLimits()                                   # 10 s, 512 MiB, 64 processes, 16 MiB files, 1 MiB output
    SandboxLimits(timeout=2.0, memory=256 * 2**20)
    limits.replace(timeout=5)                         # a copy with one field changed, checked again

Each field and how it is enforced:

- ``timeout`` (seconds, wall clock): the parent kills the sandbox's process
  group (and with it its pid namespace) when it passes; status "timeout".
  RLIMIT_CPU is set to ``ceil(timeout) + 1`` s of CPU time per process
  (SIGXCPU, also reported as "timeout"), the hard limit a second later.
- ``memory`` (bytes): the whole program's memory, where it runs in a cgroup
  leaf of its own (``cgroup.py``: the kernel kills its processes past it,
  status "memory"); and RLIMIT_AS, the address space of each process, always
  (an allocation past it fails: Python's MemoryError, status "memory").
  Without a leaf the program holds at most ``memory x processes`` in all.
- ``processes``: the processes and threads the program may have at once: the
  leaf's ``pids.max``, and RLIMIT_NPROC always (a fork past either fails with
  EAGAIN). Root ignores RLIMIT_NPROC, so a root parent runs the program as an
  unprivileged uid (``isolation.py``).
- ``file_size`` (bytes): RLIMIT_FSIZE, the largest file the program may
  write (a write past it fails with EFBIG, status "file_size").
- ``output`` (bytes): stdout and stderr together; the parent reads at most
  this much, then kills the program (status "output", the text truncated).
- ``open_files``: RLIMIT_NOFILE, open file descriptors per process.
- ``disk`` (bytes): the size of each of the two tmpfs a bwrap sandbox writes
  to (its work dir and its /tmp); a write past it fails with ENOSPC (status
  "file_size"). The other levels write to the host's disk and do not bound
  the total (each file is still bounded by ``file_size``).

Core dumps are always off (RLIMIT_CORE 0).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["SandboxLimits", "rlimit_values"]

MiB = 2**20


def _positive(name: str, value: Any, integer: bool) -> str | None:
    kind = "a positive integer" if integer else "a positive number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} must be {kind}, got {type(value).__name__} {value!r}"
    if integer and not isinstance(value, int):
        return f"{name} must be {kind}, got {value!r}"
    if not math.isfinite(value) or value <= 0:
        return f"{name} must be {kind}, got {value!r}"
    return None


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed program (see the module docstring for how each is enforced)."""

    timeout: float = 10.0  # wall-clock seconds
    memory: int = 512 * MiB  # bytes: the whole program's (a cgroup leaf) and each process's (RLIMIT_AS)
    processes: int = 64  # processes and threads at once (the leaf's pids.max, RLIMIT_NPROC)
    file_size: int = 16 * MiB  # bytes per written file (RLIMIT_FSIZE)
    output: int = 1 * MiB  # bytes of stdout + stderr captured before the program is killed
    open_files: int = 64  # file descriptors per process (RLIMIT_NOFILE)
    disk: int = 64 * MiB  # bytes of each tmpfs (work dir, /tmp) under bwrap

    def __post_init__(self) -> None:
        problems = [_positive("timeout", self.timeout, integer=False)]
        problems += [_positive(name, getattr(self, name), integer=True)
                     for name in ("memory", "processes", "file_size", "output", "open_files", "disk")]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("invalid sandbox limits: " + "; ".join(problems))

    def replace(self, **changes: Any) -> "SandboxLimits":
        """A copy with ``changes`` applied (None values ignored), validated again."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown sandbox limits {unknown}; the limits are "
                             f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @property
    def cpu_seconds(self) -> int:
        """RLIMIT_CPU's soft limit: the wall-clock timeout rounded up, plus one second."""
        return math.ceil(self.timeout) + 1


def rlimit_values(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    """``{resource name: (soft, hard)}`` as ``resource.setrlimit`` and ``prlimit`` take them."""
    return {
        "RLIMIT_CPU": (limits.cpu_seconds, limits.cpu_seconds + 1),
        "RLIMIT_AS": (limits.memory, limits.memory),
        "RLIMIT_NPROC": (limits.processes, limits.processes),
        "RLIMIT_FSIZE": (limits.file_size, limits.file_size),
        "RLIMIT_NOFILE": (limits.open_files, limits.open_files),
        "RLIMIT_CORE": (0, 0),
    }
