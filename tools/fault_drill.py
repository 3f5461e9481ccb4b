"""Fault drills: a real ``hybridflow train`` run, faults injected at chosen points, each one timed.

    drill = Drill(command, run_dir, env)          # started; its console goes to run_dir.parent / console.txt
    drill.wait(lambda: 1 in drill.steps())        # step 1 logged
    drill.fault("hang", lambda: os.kill(drill.rank_pid(1), signal.SIGSTOP),
                found="passed its deadline", recovered=2)   # timed: the text seen, step 2 logged after it
    drill.finish(timeout=300)
    drill.times   # {"hang": {"found_s": 8.3, "recovered_s": 31.0}}

``found_s`` runs from the fault to the console line that reports it; ``recovered_s`` from the fault to the
first step logged after it (the restarted run's first new step). The tests of automatic restart
(``tests/faults/test_faults_cli.py``, ``tests/test_ray_multinode.py``) drive their runs with it; run as a
script it performs the same drills outside the suite and prints the figures the README's faults table holds:

    python tools/fault_drill.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESUMED = re.compile(r"resumed at step (\d+)")  # a restarted run's line: the step its checkpoint holds

__all__ = ["Drill", "rank_pid"]


def rank_pid(root_pid: int, rank: int) -> int:
    """The pid of torchrun's rank ``rank`` among ``root_pid``'s descendants (its environment says RANK)."""
    import psutil

    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "controller.cli" in " ".join(child.cmdline()):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise LookupError(f"no rank {rank} process under {root_pid}")


class Drill:
    def __init__(self, command: list[str], run_dir: Path, env: dict[str, str] | None = None,
                 deadline_s: float = 300) -> None:
        self.run_dir = Path(run_dir)
        self.console = self.run_dir.parent / f"{self.run_dir.name}.console.txt"
        self.deadline_s = deadline_s
        self.times: dict[str, dict[str, float]] = {}
        self.stopped: list[int] = []  # processes stopped (SIGSTOP) by ``stop``: killed at the end whatever happens
        with open(self.console, "w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                              **(env or {})})

    def text(self) -> str:
        return self.console.read_text()

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def steps(self) -> list[int]:
        return [r["step"] for r in self.records()]

    def rank_pid(self, rank: int) -> int:
        return rank_pid(self.proc.pid, rank)

    def stop(self, pid: int) -> None:
        """SIGSTOP ``pid`` (a hang); ``kill`` ends it later if the run has not."""
        self.stopped.append(pid)
        os.kill(pid, signal.SIGSTOP)

    def wait(self, condition: Callable[[], bool], what: str = "the condition") -> float:
        """Poll until ``condition()``; returns the time it held (time.monotonic)."""
        deadline = time.monotonic() + self.deadline_s
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the run ended or took over {self.deadline_s:g} s before {what}:\n"
                                     f"{self.text()[-5000:]}")
            time.sleep(0.1)
        return time.monotonic()

    def fault(self, name: str, inject: Callable[[], object], found: str, recovered: int | None = None) -> None:
        """Inject a fault; time the console line holding ``found`` (new since the fault) and step ``recovered``
        logged again after it. ``recovered`` None: the first step after the one the restarted run resumed at
        (its "resumed at step N" line), wherever the fault landed: a step that finished and was checkpointed
        before the fault took effect is not run again."""
        seen = len(self.text())
        start = time.monotonic()
        inject()
        found_at = self.wait(lambda: found in self.text()[seen:], f"{name} was reported")
        if recovered is None:
            self.wait(lambda: RESUMED.search(self.text()[seen:]) is not None, f"the restart after {name} resumed")
            recovered = int(RESUMED.search(self.text()[seen:])[1]) + 1
        # The restarted run truncates the metrics to its checkpoint, then logs the step again.
        before = {r["step"]: r for r in self.records()}.get(recovered)
        recovered_at = self.wait(lambda: any(r["step"] == recovered and r != before for r in self.records()),
                                 f"step {recovered} after {name}")
        self.times[name] = {"found_s": round(found_at - start, 2), "recovered_s": round(recovered_at - start, 2)}

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.stopped:  # (a stopped process never exits by itself)
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass


# ------------------------------------------------------------------ the drills run as a script
def _torchrun_drill(work: Path, model: str) -> dict:
    from faults.test_faults_cli import JOB

    drill = Drill([sys.executable, "-m", "controller.cli", "train", *JOB, "algorithm.name=grpo", f"model_path={model}",
                   f"trainer.run_dir={work / 'torchrun'}", "trainer.max_restarts=2", "trainer.hang_timeout_s=8",
                   "trainer.total_steps=5"], work / "torchrun")
    try:
        drill.wait(lambda: 1 in drill.steps(), "step 1")
        drill.fault("torchrun: a rank stopped (SIGSTOP)", lambda: drill.stop(drill.rank_pid(1)),
                    found="passed its deadline", recovered=2)
        drill.wait(lambda: 3 in drill.steps(), "step 3")
        drill.fault("torchrun: a rank killed (SIGKILL)", lambda: os.kill(drill.rank_pid(1), signal.SIGKILL),
                    found="[hybridflow] restart 2 ", recovered=4)
        code = drill.finish()
    finally:
        drill.kill()
    assert code == 0, drill.text()[-3000:]
    return drill.times


def _ray_drill(work: Path, model: str) -> dict:
    from loopback_cluster import LoopbackCluster
    from test_ray_multinode import RESTART_JOB

    cluster = LoopbackCluster(["127.0.0.11", "127.0.0.12"], cpus_per_node=4)
    try:
        drill = Drill([sys.executable, "-m", "controller.cli", "train", *RESTART_JOB, f"model_path={model}",
                       f"trainer.ray_address={cluster.address}", f"trainer.run_dir={work / 'ray'}",
                       "trainer.nnodes=2", "trainer.max_restarts=1", "trainer.total_steps=5"], work / "ray",
                      env={"HYBRIDFLOW_NODE_IP": cluster.head_ip})
        try:
            drill.wait(lambda: 2 in drill.steps(), "step 2")
            drill.fault("Ray: a node killed", lambda: cluster.kill_node("127.0.0.12"),
                        found="[hybridflow] the job failed")
            code = drill.finish()
        finally:
            drill.kill()
    finally:
        cluster.shutdown()
    assert code == 0, drill.text()[-3000:]
    return drill.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the tests' jobs and their loopback cluster
    from controller.models.builtin import resolve_model_path

    with tempfile.TemporaryDirectory(prefix="fault-drill-") as scratch:
        work = Path(scratch)
        model = resolve_model_path("builtin:tiny-arithmetic", work / "model")
        times = {**_torchrun_drill(work, model), **_ray_drill(work, model)}
    for name, figures in times.items():
        print(f"{name:40s} found after {figures['found_s']:6.2f} s, training again after {figures['recovered_s']:6.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(times, indent=2))


if __name__ == "__main__":
    main()
