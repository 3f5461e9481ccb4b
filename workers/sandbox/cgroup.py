"""A cgroup leaf per sandboxed program: its memory and process count bounded as a whole, and every process of
it killed at the end, whatever sessions it made.

Resource limits (``limits.py``) are per process: RLIMIT_AS bounds each process's address space, so a
program of many processes could hold ``memory x processes`` in all. Where this process may create cgroups
(root, or a cgroup delegated to its user), each program runs in a leaf of its own instead:

- cgroup v2 (one unified hierarchy): ``memory.max`` = ``limits.memory``, ``memory.swap.max`` = 0 and
  ``pids.max`` = ``limits.processes``, in a leaf beside this process's own cgroup's;
- cgroup v1: a leaf in the ``memory`` hierarchy (``memory.limit_in_bytes``, and
  ``memory.memsw.limit_in_bytes`` where swap is accounted) and one in the ``pids`` hierarchy (``pids.max``),
  each under this process's cgroup of that hierarchy.

The program's first process joins the leaves before it runs anything (``join_argv``): a shell writes ``0``
(itself) into each leaf's ``tasks`` (v2: ``cgroup.procs``), then execs the launch chain, so every process the
program ever makes is inside, setsid or not. (A single thread moving itself skips the kernel's global cgroup
lock; writing a process's pid takes it, about 6 ms a write on this machine.) The kernel then counts all of them together: past the memory bound
it kills one (the OOM killer, status "memory" with the reason); past the process bound a fork fails with
EAGAIN. At the end ``kill_all`` kills every process still in the leaves, and ``remove`` deletes them.

``available()`` probes once per process whether a leaf can be made and bounded here; where it cannot
(an unprivileged user without a delegated cgroup), the bound is the per-process one, ``memory x
processes`` in all, as ``memory_bound`` says.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from workers.sandbox.limits import SandboxLimits

__all__ = ["CgroupLeaf", "JOIN_FAILED", "available", "create", "join_argv", "memory_bound"]

ROOT = Path("/sys/fs/cgroup")
JOIN_FAILED = "hybridflow-sandbox: cannot join the program's cgroup"
# The first process (one thread) moves itself into each leaf, then becomes the launch chain.
_JOIN = ('while [ "$1" != "--" ]; do echo 0 > "$1" 2>/dev/null || { echo "' + JOIN_FAILED + ' $1" >&2; exit 125; }; '
         'shift; done; shift; exec "$@"')


def _own_paths() -> dict[str, str]:
    """This process's cgroup per hierarchy: {"": path} on v2, {"memory": path, "pids": path, ...} on v1."""
    paths = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(","):
                paths[name] = path
    except OSError:
        pass
    return paths


@dataclass(frozen=True)
class _Hierarchies:
    """Where leaves go: v2's one parent directory, or v1's memory and pids parents."""

    version: int
    parents: dict[str, Path]  # controller ("memory", "pids"; v2: "unified") -> the directory leaves go in


def _hierarchies() -> _Hierarchies | None:
    own = _own_paths()
    unified = ROOT / "cgroup.controllers"
    if unified.exists():  # v2 at the root: leaves beside this process's cgroup (a v2 cgroup with processes
        # cannot have children with controllers, so the leaf is its sibling, under the same parent)
        here = ROOT / own.get("", "/").lstrip("/")
        parent = here.parent if here != ROOT else here
        controllers = (parent / "cgroup.subtree_control").read_text().split() if (parent / "cgroup.subtree_control").exists() else []
        if {"memory", "pids"} <= set(controllers):
            return _Hierarchies(2, {"unified": parent})
        return None
    parents = {}
    for name in ("memory", "pids"):
        base = ROOT / name
        if not (base / "cgroup.procs").exists() or name not in own:
            return None
        parents[name] = base / own[name].lstrip("/")
    return _Hierarchies(1, parents)


class CgroupLeaf:
    """One program's cgroup leaves (v1: memory and pids; v2: one)."""

    def __init__(self, hierarchies: _Hierarchies, limits: SandboxLimits) -> None:
        self.version = hierarchies.version
        name = f"hybridflow-sandbox-{uuid.uuid4().hex[:12]}"
        self.dirs: dict[str, Path] = {}
        try:
            for controller, parent in hierarchies.parents.items():
                path = parent / name
                path.mkdir()
                self.dirs[controller] = path
            self._bound(limits)
        except OSError:
            self.remove()
            raise

    def _write(self, controller: str, file: str, value: int | str, required: bool = True) -> None:
        path = self.dirs[controller] / file
        if not required and not path.exists():
            return
        path.write_text(f"{value}\n")

    def _bound(self, limits: SandboxLimits) -> None:
        if self.version == 2:
            self._write("unified", "memory.max", limits.memory)
            self._write("unified", "memory.swap.max", 0, required=False)
            self._write("unified", "pids.max", limits.processes)
        else:
            self._write("memory", "memory.limit_in_bytes", limits.memory)
            self._write("memory", "memory.memsw.limit_in_bytes", limits.memory, required=False)
            self._write("pids", "pids.max", limits.processes)

    @property
    def procs_files(self) -> list[str]:
        return [str(path / "cgroup.procs") for path in self.dirs.values()]

    @property
    def join_files(self) -> list[str]:
        """Where a process moves itself in: v1's ``tasks`` (one thread, no global lock), v2's ``cgroup.procs``."""
        return [str(path / ("cgroup.procs" if self.version == 2 else "tasks")) for path in self.dirs.values()]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for file in self.procs_files:
            try:
                found |= {int(line) for line in Path(file).read_text().split()}
            except (OSError, ValueError):
                continue
        return found

    def oom_kills(self) -> int:
        """How many of the program's processes the kernel killed at the memory bound."""
        if self.version == 2:
            events = self.dirs["unified"] / "memory.events"
        else:
            events = self.dirs["memory"] / "memory.oom_control"
        try:
            fields = dict(line.split() for line in events.read_text().splitlines() if len(line.split()) == 2)
        except OSError:
            return 0
        if "oom_kill" in fields:
            return int(fields["oom_kill"])
        try:  # an older v1 kernel counts no kills: any time the usage hit the bound counts
            return int((self.dirs["memory"] / "memory.failcnt").read_text()) if self.version == 1 else 0
        except (OSError, ValueError):
            return 0

    def peak_bytes(self) -> int | None:
        """The most memory the leaf's processes held at once (None where the kernel does not say)."""
        path = (self.dirs["unified"] / "memory.peak" if self.version == 2
                else self.dirs["memory"] / "memory.max_usage_in_bytes")
        try:
            return int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill_all(self, within_s: float = 5.0) -> bool:
        """SIGKILL every process in the leaves until none is left (a fork in progress joins them too);
        whether they emptied within ``within_s``."""
        kill_file = self.dirs.get("unified", Path("/nonexistent")) / "cgroup.kill"
        deadline = time.monotonic() + within_s
        while True:
            if kill_file.exists():
                try:
                    kill_file.write_text("1\n")
                except OSError:
                    pass
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def remove(self) -> None:
        """Delete the leaves (once empty: a killed process leaves its cgroup when it is reaped)."""
        deadline = time.monotonic() + 5.0
        for path in list(self.dirs.values()):
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)


_lock = threading.Lock()
_probed: list[_Hierarchies | None] = []


def _probe() -> _Hierarchies | None:
    hierarchies = _hierarchies()
    if hierarchies is None:
        return None
    try:
        CgroupLeaf(hierarchies, SandboxLimits()).remove()
    except OSError:
        return None
    return hierarchies


def available() -> bool:
    """Whether programs here run in cgroup leaves of their own (probed once per process)."""
    return _cached() is not None


def _cached() -> _Hierarchies | None:
    with _lock:
        if not _probed:
            _probed.append(_probe())
        return _probed[0]


def create(limits: SandboxLimits) -> CgroupLeaf | None:
    """A leaf bounded by ``limits``, or None where cgroups are not available here."""
    hierarchies = _cached()
    return CgroupLeaf(hierarchies, limits) if hierarchies is not None else None


def join_argv(leaf: CgroupLeaf, argv: list[str]) -> list[str]:
    """``argv`` started inside ``leaf``: its first process joins, then execs ``argv``."""
    return ["/bin/sh", "-c", _JOIN, "sh", *leaf.join_files, "--", *argv]


def memory_bound(limits: SandboxLimits) -> int:
    """The most memory a program under ``limits`` can hold in all, here: ``limits.memory`` in a cgroup
    leaf, else ``limits.memory`` per process for at most ``limits.processes`` processes."""
    return limits.memory if available() else limits.memory * limits.processes
