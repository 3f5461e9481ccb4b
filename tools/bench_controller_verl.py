"""verl 0.9.1's own RayWorkerGroup on tools/bench_controller.py's benchmark: startup, round trip, scatter+gather.

    build/verl-venv/bin/python tools/bench_controller_verl.py --workers 4 --repeats 15 --rtt-calls 200 --json out.json
    python -c "from tools.verl_venv import run_verl_bench; print(run_verl_bench(4, 15, 200))"  # from the project

It runs in verl's own virtual environment (``tools/verl_venv.py:ensure_verl_venv``
creates ``build/verl-venv``: torch 2.13.0, verl[verl-core] 0.9.1, ray 2.60.0) and
imports nothing from the project; the project never imports verl. The group is
verl's: ``RayResourcePool([workers], use_gpu=False)`` (its default 10 logical
CPUs a bundle, one STRICT_PACK placement group), ``RayClassWithInitArgs`` and
``RayWorkerGroup`` of a ``verl.single_controller.base.Worker`` subclass whose
``ping`` is registered with verl's ``Dispatch.ONE_TO_ALL`` and whose ``echo``
(returns its DataProto chunk unchanged) with ``Dispatch.DP_COMPUTE_PROTO``.

Each row (a serialisation at a group size) gets a Ray cluster of its own,
private and local (``address="local"``), its start reported apart: a second
group in one cluster measured slower here (startup 11.6 s against 7.8 s,
scatter+gather up to 3x), the first group's killed processes sharing the two
cores. Every process of it stays on 127.0.0.1: ``LOOPBACK_ENV`` is set before
``ray.init`` (Ray 2.60 turns ``_node_ip_address="127.0.0.1"`` into the
machine's interface address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, its
dashboard process, started even with the dashboard off, probes the cloud
metadata addresses whatever the usage-stats setting, and RAY_DISABLE_USAGE_STATS
is not its switch: RAY_USAGE_STATS_ENABLED=0 is), and the driver refuses any
other connect. Its logical CPU count is at least 32 and large enough for
verl's bundles. Per row it prints, as tools/bench_controller.py does:
  - startup_s:   from creating the resource pool until the group's first ping
                 answered (placement group, actor processes and their imports);
  - rtt_ms:      median round trip of the ONE_TO_ALL ping (``--rtt-calls`` calls
                 after 5 warm-ups);
  - scatter_gather: a 1024x512 int64 batch with 3 tensor keys (12 MiB) split
                 over the ranks with DP_COMPUTE_PROTO and returned whole (one
                 warm-up that checks the echo equals the input, then
                 ``--repeats`` timed calls, median; the JSON has min and max
                 too); MiB/s counts the bytes out plus the bytes back,
                 samples/s the rows;
  - bare_ray_ping_ms: the same cluster's floor, as many plain Ray actors with a
                 trivial method, median of ``ray.get([a.ping.remote() ...])``,
                 after the verl group is gone.
The machine is shared: each row records the 1-minute load average before and
after it.

verl pickles a DataProto (``verl/protocol.py``, ``DataProto.__getstate__`` and
``__setstate__``) one of two ways, chosen by the environment variable
``VERL_DATAPROTO_SERIALIZATION_METHOD`` read at every pickle and unpickle:
"numpy" sends each tensor's bytes as a uint8 numpy array (Ray passes those
out of band), anything else (unset: the default) ``torch.save``s the
consolidated TensorDict into bytes. Both ends must agree, so each group is
started with the variable in its ``worker_env`` and the driver sets it too;
``--serialization`` picks which to run (default both, labelled ``torch`` and
``numpy`` in the rows).
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROWS, COLS, KEYS = 1024, 512, 3
SERIALIZATIONS = ("torch", "numpy")
SERIALIZATION_ENV = "VERL_DATAPROTO_SERIALIZATION_METHOD"


# Set before ray.init, so the whole cluster's processes inherit them (see the module docstring).
LOOPBACK_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # Ray 2.60's switch; RAY_DISABLE_USAGE_STATS is read by nothing in it
    "RAY_DISABLE_USAGE_STATS": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # _node_ip_address="127.0.0.1" stays 127.0.0.1
    # the dashboard process's cloud probe (169.254.169.254, metadata.google.internal) meets a closed loopback port
    **{name: "http://127.0.0.1:9" for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY")},
    **{name: "127.0.0.1,localhost,::1" for name in ("no_proxy", "NO_PROXY")},
}


def _forbid_non_loopback_connects() -> None:
    """Fail any socket connect of this process to a non-loopback address (the benchmark stays on 127.0.0.1)."""
    def hook(event, args):
        if event != "socket.connect" or len(args) < 2:
            return
        address = args[1]
        if not (isinstance(address, tuple) and address and isinstance(address[0], str)):
            return  # a Unix socket
        host = address[0]
        try:
            loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise ConnectionRefusedError(f"bench_controller_verl: refusing to connect to {address!r}")

    sys.addaudithook(hook)


@functools.cache
def _classes():
    """verl's worker-group classes and this benchmark's worker and bare actor (imports verl: its venv only)."""
    import ray
    from verl.protocol import DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    class EchoWorker(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def ping(self) -> int:
            return self.rank

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def echo(self, batch: DataProto) -> DataProto:
            return batch

    @ray.remote
    class BareActor:
        def ping(self) -> int:
            return 0

    return DataProto, EchoWorker, BareActor, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


def _teardown(group, pool) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for worker in group.workers:
        ray.kill(worker)
    for pg in pool.pgs or []:
        remove_placement_group(pg)


def measure(workers: int, repeats: int, rtt_calls: int, serialization: str) -> dict:
    import torch

    DataProto, EchoWorker, _, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup = _classes()
    import ray

    os.environ[SERIALIZATION_ENV] = serialization  # the driver's side of the pickling; the workers get it below
    started = time.time()
    pool = RayResourcePool([workers], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(EchoWorker)),
                           worker_env={SERIALIZATION_ENV: serialization})
    ranks = group.ping()
    startup_s = time.time() - started
    assert ranks == list(range(workers)), ranks

    for _ in range(5):
        group.ping()
    rtts = []
    for _ in range(rtt_calls):
        t0 = time.perf_counter()
        group.ping()
        rtts.append(time.perf_counter() - t0)

    batch = DataProto.from_dict({f"key{k}": torch.randint(0, 1 << 30, (ROWS, COLS)) for k in range(KEYS)})
    nbytes = sum(t.numel() * t.element_size() for t in batch.batch.values())
    back = group.echo(batch)  # warm-up, and a correctness check
    assert isinstance(back, DataProto) and len(back) == ROWS, type(back)
    assert sorted(back.batch.keys()) == sorted(batch.batch.keys())
    assert all(torch.equal(back.batch[k], batch.batch[k]) for k in batch.batch.keys())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        group.echo(batch)
        times.append(time.perf_counter() - t0)
    _teardown(group, pool)
    median = statistics.median(times)
    return {
        "backend": "verl-ray",
        "serialization": serialization,
        "workers": workers,
        "startup_s": round(startup_s, 3),
        "rtt_ms": round(1e3 * statistics.median(rtts), 3),
        "scatter_gather_ms": round(1e3 * median, 2),
        "scatter_gather_min_ms": round(1e3 * min(times), 2),
        "scatter_gather_max_ms": round(1e3 * max(times), 2),
        "scatter_gather_MiBps": round(2 * nbytes / median / 2**20, 1),
        "samples_per_s": round(ROWS / median, 1),
        "payload_MiB": round(nbytes / 2**20, 2),
    }


def bare_ray_ping_ms(actors: int, calls: int) -> float:
    """Median ms of one ``ray.get`` over a trivial call to each of ``actors`` plain actors (after 5 warm-ups)."""
    import ray

    BareActor = _classes()[2]
    handles = [BareActor.remote() for _ in range(actors)]
    ray.get([a.ping.remote() for a in handles])
    for _ in range(5):
        ray.get([a.ping.remote() for a in handles])
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ray.get([a.ping.remote() for a in handles])
        times.append(time.perf_counter() - t0)
    for a in handles:
        ray.kill(a)
    return round(1e3 * statistics.median(times), 3)


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("verl", "ray", "torch", "tensordict", "numpy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", nargs="+", type=int, default=[4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rtt-calls", type=int, default=200)
    parser.add_argument("--serialization", nargs="+", default=list(SERIALIZATIONS), choices=SERIALIZATIONS)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()

    os.environ.update(LOOPBACK_ENV)
    _forbid_non_loopback_connects()
    t0 = time.perf_counter()
    import ray

    _classes()  # verl's imports, before the clock of any group
    meta = {"import_s": round(time.perf_counter() - t0, 2), "versions": _versions()}

    rows = []
    for workers in args.workers:
        for serialization in args.serialization:
            load_before = os.getloadavg()[0]
            t0 = time.perf_counter()
            ray.init(address="local", num_cpus=max(32, os.cpu_count() or 1, 10 * workers + 8),
                     include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True,
                     configure_logging=False)
            cluster_start_s = time.perf_counter() - t0
            try:
                row = measure(workers, args.repeats, args.rtt_calls, serialization)
                row["bare_ray_ping_ms"] = bare_ray_ping_ms(workers, args.rtt_calls)
            finally:
                ray.shutdown()
            row.update(ray_cluster_start_s=round(cluster_start_s, 2), verl_version=meta["versions"]["verl"],
                       load_1min_before=round(load_before, 2), load_1min_after=round(os.getloadavg()[0], 2))
            rows.append(row)

    header = (f"{'backend':9} {'serial.':7} {'workers':>7} {'ray_start_s':>11} {'startup_s':>9} {'rtt_ms':>7} "
              f"{'scatter+gather_ms':>17} {'MiB/s':>8} {'samples/s':>10} {'bare_ray_ms':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['backend']:9} {r['serialization']:7} {r['workers']:7d} {r['ray_cluster_start_s']:11.2f} "
            f"{r['startup_s']:9.2f} {r['rtt_ms']:7.2f} "
            f"{r['scatter_gather_ms']:17.1f} {r['scatter_gather_MiBps']:8.1f} {r['samples_per_s']:10.0f} "
            f"{r['bare_ray_ping_ms']:11.3f}"
        )
    print(f"(each row on a fresh local Ray cluster, whose start is ray_start_s, before the pool; importing verl "
          f"took {meta['import_s']:.1f} s; 1-min load {rows[0]['load_1min_before']:.1f} before the first row, "
          f"{rows[-1]['load_1min_after']:.1f} after the last)")
    print(f"(batch: {ROWS}x{COLS} int64 x {KEYS} keys = {ROWS * COLS * 8 * KEYS / 2**20:.0f} MiB each way; medians; "
          f"verl {meta['versions']['verl']}, ray {meta['versions']['ray']}, torch {meta['versions']['torch']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, **meta}, indent=2))


if __name__ == "__main__":
    main()
