"""HangWatch: a deadline on every worker-group call, from the phase's own recent durations, and what to do when
one passes: every rank's Python stack into the run directory, the rank that never reached the collective
named, the run stopped well before the backend's own timeout.

::

    watch = HangWatch(run_dir / "hangs", fixed_s=None)     # trainer.hang_timeout_s
    group = WorkerGroup(pool, Actor, ..., watch=watch)     # each call's deadline: watch.deadline_s(role, method)

The deadline of a call to ``role.method``: ``fixed_s`` when set (``trainer.hang_timeout_s``), else ``factor``
(10) times the slowest of the phase's last ``history`` (8) durations, and at least ``min_s`` (60 s); a phase's
first call, which compiles and warms up (or saves a large checkpoint), gets ``first_s`` (1500 s, under the
backends' 1800). When a call passes it:

1. Every rank of the pool is asked for its Python stack: ``py-spy dump --nonblocking`` where py-spy is
   installed (it reads a stopped or hung process without its help), else ``faulthandler`` through SIGUSR1
   (each worker process registers it at start: ``workers.stack_dump``); the controller's own process dumps
   itself. Each goes to ``<run_dir>/hangs/<time>_<role>.<method>/rank_<r>.txt``.
2. Each late rank is classified from its process state and stack: ``stopped`` (its process is in state T,
   SIGSTOP), ``in a collective`` (a torch.distributed call on its stack: it waits for the others), or
   ``elsewhere`` (it never reached the collective). The stopped and the elsewhere ranks are the ones named.
3. ``HangError`` (a ``TrainingStoppedError``: the CLI exits 3) carries the report. Before it is raised, the
   named ranks' processes on this node are killed, so that the launcher (torchrun) and the pool can stop.

A rank on another node is described (node and pid) but not dumped: its stack is on that node.
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from pathlib import Path

from controller.errors import TrainingStoppedError
from workers.stack_dump import stack_dump_path

__all__ = ["HangError", "HangWatch"]

# A frame of a collective, or of megatron's gradient reduction waiting on one (py-spy and faulthandler forms).
_COLLECTIVE = re.compile(r"distributed_c10d\.py|ProcessGroup(?:Gloo|NCCL)|torch/distributed/|megatron/core/distributed/"
                         r"|\b(?:all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|barrier|all_to_all\w*|"
                         r"finish_grad_sync|start_grad_sync)\b")
_TOP_FRAMES = 6  # frames of a named rank's stack shown in the console


class HangError(TrainingStoppedError):
    """A worker-group call passed its deadline; the message names the ranks that never reached the collective."""


def _process_state(pid: int) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        return None
    return None


def _this_node() -> set[str | None]:
    names = {None, "127.0.0.1", "localhost", socket.gethostname()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return names


class HangWatch:
    def __init__(self, directory: str | Path | None, fixed_s: float | None = None, min_s: float = 60.0,
                 factor: float = 10.0, first_s: float = 1500.0, history: int = 8) -> None:
        self.directory = Path(directory) if directory is not None else None  # None: a temp dir, at a hang
        self.fixed_s, self.min_s, self.factor, self.first_s = fixed_s, min_s, factor, first_s
        self._durations: dict[str, deque] = defaultdict(lambda: deque(maxlen=history))
        self._pids: dict[int, list[int]] = {}  # id(pool) -> each rank's pid, asked while the pool answers
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- deadlines
    def deadline_s(self, role: str, method: str) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        with self._lock:
            recent = self._durations.get(f"{role}.{method}")
            return max(self.min_s, self.factor * max(recent)) if recent else self.first_s

    def record(self, role: str, method: str, seconds: float) -> None:
        with self._lock:
            self._durations[f"{role}.{method}"].append(seconds)

    def note_pool(self, pool) -> None:
        """Ask ``pool``'s ranks their pids now, while they answer (a hung rank cannot)."""
        if id(pool) not in self._pids:
            self._pids[id(pool)] = list(pool.pids())

    # ---------------------------------------------------------------- a hang
    def hung(self, group, method: str, late: list[int], waited_s: float) -> HangError:
        """Dump every rank's stack, classify the late ones, kill the named ones here; the error to raise."""
        pool, hosts = group.pool, group.pool.hosts
        pids = self._pids.get(id(pool)) or [None] * group.world_size
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = self.directory or Path(tempfile.mkdtemp(prefix="hybridflow-hangs-"))
        where = base / f"{stamp}_{group.role}.{method}"
        where.mkdir(parents=True, exist_ok=True)
        local = _this_node() | {hosts.node_of(r) for r, pid in enumerate(pids) if pid == os.getpid()}
        here = {rank: hosts.node_of(rank) in local or str(hosts.node_of(rank)).startswith("127.")
                for rank in range(len(pids))}
        stacks = {rank: self._stack(pid, where / f"rank_{rank}.txt") if here[rank] else None
                  for rank, pid in enumerate(pids)}
        verdicts = {}
        for rank in late:
            pid = pids[rank] if rank < len(pids) else None
            state = _process_state(pid) if pid is not None and here.get(rank) else None
            stack = stacks.get(rank) or ""
            if state == "T":
                verdicts[rank] = "stopped (its process is in state T: SIGSTOP)"
            elif _COLLECTIVE.search(stack):
                verdicts[rank] = "in a collective (waiting for the others)"
            elif stack:
                verdicts[rank] = "elsewhere: it never reached the collective"
            else:
                verdicts[rank] = "its stack could not be read"
        named = [r for r in late if not verdicts[r].startswith("in a collective")] or list(late)
        lines = [f"{group.role}.{method} passed its deadline of {waited_s:g} s: ranks {late} of {group.world_size} "
                 f"did not answer; {len(named)} never reached the collective the others wait in:"]
        for rank in named:
            pid = pids[rank] if rank < len(pids) else None
            lines.append(f"  rank {rank} (pid {pid}, {hosts.describe_ranks([rank])}): {verdicts[rank]}")
            top = [line for line in (stacks.get(rank) or "").splitlines() if line.strip()][:_TOP_FRAMES + 2]
            lines += [f"    {line.strip()}" for line in top]
        others = [r for r in late if r not in named]
        if others:
            lines.append(f"  ranks {others}: in a collective (waiting for the ranks above)")
        lines.append(f"  every rank's stack: {where}/rank_<r>.txt")
        (where / "report.txt").write_text("\n".join(lines) + "\n")
        for rank in named:  # so that the launcher and the pool can stop: a stopped process never exits
            pid = pids[rank] if rank < len(pids) else None
            if pid is not None and pid != os.getpid() and here.get(rank):
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
                hosts.mark_lost(rank, f"hung in {group.role}.{method} and killed")
        return HangError("\n".join(lines))

    @staticmethod
    def _stack(pid: int | None, path: Path) -> str | None:
        """``pid``'s Python stacks into ``path`` (py-spy, else faulthandler by SIGUSR1); the text or None."""
        if pid is None:
            return None
        if pid == os.getpid():
            with open(path, "w") as out:
                faulthandler.dump_traceback(file=out, all_threads=True)
            return path.read_text()
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
        if spy:
            try:
                done = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                                      text=True, timeout=30)
                if done.returncode == 0 and done.stdout.strip():
                    path.write_text(done.stdout)
                    return done.stdout
            except (OSError, subprocess.SubprocessError):
                pass
        dump = stack_dump_path(pid)
        try:
            before = dump.stat().st_size if dump.exists() else 0
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            return None
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if dump.exists() and dump.stat().st_size > before:
                time.sleep(0.2)  # the handler writes the threads one after another
                text = dump.read_text()[before:]
                path.write_text(text)
                return text
            time.sleep(0.05)
        return None
