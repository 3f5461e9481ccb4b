"""What the sandbox costs: trivial programs (``print(1)``) a second, one at a time and four at once, per level.

    python tools/bench_sandbox.py --json docs/bench/sandbox.json

For each isolation level that runs here (``workers.sandbox.available_levels``), ``--runs`` programs one
after the other (concurrency 1), then ``--runs`` programs through a ``Sandbox`` pool of 4 (concurrency 4),
after ``--warmup`` runs. The baseline is the same interpreter started bare
(``python -I -B -c 'print(1)'``, no sandbox) at concurrency 1. Prints a table; ``--json`` writes the figures
with the machine they ran on (cores, kernel, uid, tool versions).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.sandbox import Sandbox, SandboxLimits, available_levels  # noqa: E402
from workers.sandbox.isolation import interpreter  # noqa: E402

PROGRAM = "print(1)"


def _version(command: list[str]) -> str | None:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else None


def _bare(runs: int) -> dict:
    latencies = []
    started = time.perf_counter()
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([interpreter(), "-I", "-B", "-c", PROGRAM], capture_output=True, check=True)
        latencies.append(time.perf_counter() - t)
    wall = time.perf_counter() - started
    return {"runs": runs, "runs_per_s": runs / wall, "median_latency_s": statistics.median(latencies)}


def _level(level: str, runs: int, concurrency: int, warmup: int) -> dict:
    with Sandbox(SandboxLimits(timeout=30), max_workers=concurrency, isolation=level) as box:
        for _ in range(warmup):
            assert box.run(PROGRAM).ok
        latencies: list[float] = []

        def one(_: int) -> None:
            result = box.run(PROGRAM)
            if not result.ok or result.stdout != "1\n":
                raise RuntimeError(f"{level}: {result}")
            latencies.append(result.duration_s)

        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as callers:  # callers beyond the pool's size only queue
            list(callers.map(one, range(runs)))
        wall = time.perf_counter() - started
    return {"runs": runs, "concurrency": concurrency, "runs_per_s": runs / wall,
            "median_latency_s": statistics.median(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()

    machine = {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
               "uid": os.getuid(), "bwrap": _version(["bwrap", "--version"]),
               "util_linux": _version(["unshare", "--version"])}
    levels = available_levels()
    print(f"machine: {machine}")
    results: dict = {"program": PROGRAM, "machine": machine, "bare_interpreter": _bare(args.runs), "levels": {}}
    bare = results["bare_interpreter"]
    print(f"{'level':10s} {'concurrency':>11s} {'runs/s':>8s} {'median latency':>15s}")
    print(f"{'(bare)':10s} {1:11d} {bare['runs_per_s']:8.1f} {bare['median_latency_s'] * 1000:12.1f} ms")
    for level in levels:
        results["levels"][level] = {}
        for concurrency in (1, 4):
            figures = _level(level, args.runs, concurrency, args.warmup)
            results["levels"][level][str(concurrency)] = figures
            print(f"{level:10s} {concurrency:11d} {figures['runs_per_s']:8.1f} "
                  f"{figures['median_latency_s'] * 1000:12.1f} ms")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
