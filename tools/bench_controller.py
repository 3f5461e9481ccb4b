"""Controller overhead on both backends: startup, call round trip, DataProto scatter+gather.

    python tools/bench_controller.py            # Ray and torchrun, 2 and 4 CPU workers
    python tools/bench_controller.py --json out.json --backends torchrun --workers 2
    python tools/bench_controller.py --workers 4 --verl   # and verl 0.9.1's RayWorkerGroup, same run

For each backend and group size it prints
  - startup_s:   from asking for the pool until the group's first call answered;
                 for torchrun that includes launching the processes and their
                 imports, for Ray the local cluster's own start is reported apart;
  - rtt_ms:      median round trip of a trivial ONE_TO_ALL call;
  - scatter_gather: a 1024x512 int64 batch with 3 tensor keys (12 MiB) split
                 over the ranks with DP_COMPUTE_PROTO and returned whole;
                 MiB/s counts the bytes out plus the bytes back, samples/s the rows.
torchrun runs are launched as child torchrun jobs of this script. With Ray it
also prints bare Ray in the same run, the floor any Ray controller stands on:
the median ``ray.get([a.ping.remote() for a in actors])`` of as many plain
actors, and the same scatter+gather done by hand (one ``ray.put`` of each
rank's arrays, an actor that returns them, ``ray.get`` and one concatenation
per key), each bare call right after the group's, so both see the same load.
``--verl`` adds verl 0.9.1's own RayWorkerGroup on the same task, run in its
own virtual environment (``tools/verl_venv.py``, created on first use), with
both of verl's DataProto serialisations (torch and numpy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller import ResourcePool, WorkerGroup  # noqa: E402
from tools.torchrun_job import run_torchrun_job  # noqa: E402
from workers import BaseWorker, DataProto, Dispatch, register  # noqa: E402

ROWS, COLS, KEYS = 1024, 512, 3


class EchoWorker(BaseWorker):
    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank

    @register(Dispatch.DP_COMPUTE_PROTO)
    def echo(self, batch: DataProto) -> DataProto:
        return batch


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(backend: str, workers: int, repeats: int, rtt_calls: int, started: float, bare=None) -> list[dict]:
    """The group's rows; with ``bare`` (a BareRay), its calls alternate with the group's, under the same load."""
    pool = ResourcePool([workers], backend=backend)
    group = WorkerGroup(pool, EchoWorker, role="echo")
    group.ping()
    startup_s = time.time() - started

    for _ in range(5):
        group.ping()
    rtts, bare_rtts = [], []
    for _ in range(rtt_calls):
        rtts.append(_timed(group.ping))
        if bare is not None:
            bare_rtts.append(_timed(bare.ping))

    batch = DataProto({f"key{k}": torch.randint(0, 1 << 30, (ROWS, COLS)) for k in range(KEYS)})
    nbytes = sum(t.numel() * t.element_size() for t in batch.batch.values())
    back = group.echo(batch)  # warm-up, and a correctness check
    assert all(torch.equal(back.batch[k], batch.batch[k]) for k in batch.batch)
    if bare is not None:
        bare.check(batch)
    times, bare_times = [], []
    for _ in range(repeats):
        times.append(_timed(lambda: group.echo(batch)))
        if bare is not None:
            bare_times.append(_timed(bare.scatter_gather))
    pool.shutdown()
    median = statistics.median(times)
    rows = [{
        "backend": backend,
        "workers": workers,
        "startup_s": round(startup_s, 3),
        "rtt_ms": round(1e3 * statistics.median(rtts), 3),
        "scatter_gather_ms": round(1e3 * median, 2),
        "scatter_gather_MiBps": round(2 * nbytes / median / 2**20, 1),
        "samples_per_s": round(ROWS / median, 1),
        "payload_MiB": round(nbytes / 2**20, 2),
    }]
    if bare is not None:
        rows.append({"backend": "bare-ray", "workers": workers, "rtt_ms": round(1e3 * statistics.median(bare_rtts), 3),
                     "scatter_gather_ms": round(1e3 * statistics.median(bare_times), 2)})
    return rows


class BareRay:
    """Plain Ray actors on the same cluster: the round trip and scatter+gather floor under any controller."""

    def __init__(self, workers: int) -> None:
        import ray

        @ray.remote(num_cpus=1)
        class Bare:
            def ping(self) -> int:
                return 0

            def echo(self, arrays):
                return arrays

        self.ray = ray
        self.actors = [Bare.remote() for _ in range(workers)]
        self.ping()

    def ping(self) -> None:
        self.ray.get([a.ping.remote() for a in self.actors])

    def check(self, batch: DataProto) -> None:
        self.arrays = [t.numpy() for t in batch.batch.values()]
        assert all(np.array_equal(x, y) for x, y in zip(self.arrays, self.scatter_gather()))

    def scatter_gather(self) -> list:
        ray, rows = self.ray, ROWS // len(self.actors)
        refs = [a.echo.remote(ray.put(tuple(x[r * rows:(r + 1) * rows] for x in self.arrays)))
                for r, a in enumerate(self.actors)]
        parts = ray.get(refs)
        return [np.concatenate([part[k] for part in parts]) for k in range(len(self.arrays))]

    def shutdown(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)


def run_torchrun(workers: int, repeats: int, rtt_calls: int) -> dict:
    args = ["--repeats", str(repeats), "--rtt-calls", str(rtt_calls), "--launched-at", repr(time.time())]
    return run_torchrun_job(__file__, workers, args, f"torchrun benchmark at {workers} workers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["ray", "torchrun"], choices=["ray", "torchrun"])
    parser.add_argument("--workers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rtt-calls", type=int, default=200)
    parser.add_argument("--verl", action="store_true", help="also measure verl's RayWorkerGroup (its own venv)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--inner", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.inner:
        workers = int(os.environ["WORLD_SIZE"])
        row = measure("torchrun", workers, args.repeats, args.rtt_calls, args.launched_at)[0]
        Path(args.inner).write_text(json.dumps(row))
        return

    rows, meta = [], {}
    for backend in args.backends:
        if backend == "ray":
            import ray

            from controller.runtime.ray_backend import ensure_ray

            t0 = time.perf_counter()
            ensure_ray()
            meta["ray_cluster_start_s"] = round(time.perf_counter() - t0, 2)
        for workers in args.workers:
            if backend == "ray":
                bare = BareRay(workers)
                rows += measure("ray", workers, args.repeats, args.rtt_calls, time.time(), bare)
                bare.shutdown()
            else:
                rows.append(run_torchrun(workers, args.repeats, args.rtt_calls))
        if backend == "ray":
            ray.shutdown()
    if args.verl:
        from tools.verl_venv import run_verl_bench

        for row in run_verl_bench(args.workers, args.repeats, args.rtt_calls):
            rows.append({**row, "backend": f"verl-{row['serialization']}"})

    header = f"{'backend':10} {'workers':>7} {'startup_s':>9} {'rtt_ms':>7} {'scatter+gather_ms':>17} {'MiB/s':>8} {'samples/s':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        startup = f"{r['startup_s']:9.2f}" if "startup_s" in r else f"{'':9}"
        if "samples_per_s" not in r:  # bare Ray: no DataProto, no group
            print(f"{r['backend']:10} {r['workers']:7d} {startup} {r['rtt_ms']:7.2f} {r['scatter_gather_ms']:17.1f}")
            continue
        print(
            f"{r['backend']:10} {r['workers']:7d} {startup} {r['rtt_ms']:7.2f} "
            f"{r['scatter_gather_ms']:17.1f} {r['scatter_gather_MiBps']:8.1f} {r['samples_per_s']:10.0f}"
        )
    if meta:
        print(f"(Ray's local cluster itself started in {meta['ray_cluster_start_s']:.1f} s, before the first pool)")
    print(f"(batch: {ROWS}x{COLS} int64 x {KEYS} keys = {ROWS * COLS * 8 * KEYS / 2**20:.0f} MiB each way; medians)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, **meta}, indent=2))


if __name__ == "__main__":
    main()
