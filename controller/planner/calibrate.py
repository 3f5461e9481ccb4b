"""This machine's CPU as the planner's device: measured once (``hybridflow plan --calibrate``), then read back.

Measured, in this process and in two gloo processes:

- the matmul rate of square GEMMs in fp32 and bf16 with every core (FLOP/s);
- the memory bandwidth of a large copy (bytes/s, read + write);
- gloo's all-reduce between two processes on this machine: the latency of a
  one-element call and the bandwidth of a large one.

``tools/plan_vs_measured.py --fit`` adds the framework's own host costs
(``timing.HOST_COSTS``: per call, per micro-batch and layer, per decode
step...) and the collectives' latency under a job's load, fitted to
measured runs (``planner.fit``); ``local_efficiency`` and ``local_cluster``
read them back.

The figures go to ``~/.cache/hybridflow/calibration.json`` (``HYBRIDFLOW_CALIBRATION``
names another file). ``local_cluster(processes)`` makes them a cluster of
one node with one "device" per process. The processes share the machine's
cores and memory: each gets 1/processes of the measured rates and of the
memory, as the launchers give each process cores / processes threads
(``OMP_NUM_THREADS``), so pools running at once use disjoint cores.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from controller.planner.hardware import Accelerator, Cluster, ClusterError
from controller.planner.timing import CPU_LORA_DECODE_OVERHEAD, HOST_COSTS, Efficiency

__all__ = ["calibration_path", "load_calibration", "local_cluster", "local_efficiency", "measure",
           "recalibrate", "save_calibration"]


def calibration_path() -> Path:
    return Path(os.environ.get("HYBRIDFLOW_CALIBRATION") or Path.home() / ".cache" / "hybridflow" / "calibration.json")


def _median_time(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _gemm_rate(dtype, size: int, repeats: int) -> float:
    import torch

    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    return 2 * size ** 3 / _median_time(lambda: torch.matmul(a, b), repeats)


def _copy_bandwidth(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), repeats)


def _gloo_rank(rank: int, world: int, init: str, out: str, small_repeats: int, large_bytes: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        one, big = torch.ones(1), torch.ones(large_bytes // 4)
        latency = _median_time(lambda: dist.all_reduce(one), small_repeats)
        seconds = _median_time(lambda: dist.all_reduce(big), 3)
        if rank == 0:  # a ring all-reduce moves 2 (n - 1) / n of the buffer per rank
            Path(out).write_text(json.dumps({"latency_s": latency, "bandwidth": 2 * (world - 1) / world * large_bytes / seconds}))
    finally:
        dist.destroy_process_group()


def _gloo(small_repeats: int, large_bytes: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo.json")
        mp.start_processes(_gloo_rank, args=(2, os.path.join(tmp, "init"), out, small_repeats, large_bytes), nprocs=2,
                           join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def measure(gemm_size: int = 1024, copy_bytes: int = 256 << 20, repeats: int = 5, gloo_bytes: int = 64 << 20) -> dict:
    """Every figure, with what it was measured on."""
    import torch

    from hybridengine.device import host_memory_bytes

    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    memory = host_memory_bytes()
    gloo = _gloo(50, gloo_bytes)
    return {
        "machine": {"cpu": _cpu_model(), "cores": cores, "memory_bytes": memory, "python": platform.python_version(),
                    "torch": torch.__version__},
        "fp32_flops": _gemm_rate(torch.float32, gemm_size, repeats),
        "bf16_flops": _gemm_rate(torch.bfloat16, gemm_size, repeats),
        "memory_bandwidth": _copy_bandwidth(copy_bytes, repeats),
        "gloo_latency_s": gloo["latency_s"],
        "gloo_bandwidth": gloo["bandwidth"],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "sizes": {"gemm": gemm_size, "copy_bytes": copy_bytes, "gloo_bytes": gloo_bytes},
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def save_calibration(figures: dict, path: Path | None = None) -> Path:
    """Write ``figures`` atomically (a temporary file renamed over the old one)."""
    path = path or calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(figures, indent=2))
    tmp.replace(path)
    return path


def recalibrate(path: Path | None = None) -> tuple[dict, Path]:
    """Measure this machine again and save it, keeping the host costs fitted to its runs (refit by
    ``tools/plan_vs_measured.py --fit``); the figures and where they went."""
    figures = measure()
    try:
        figures["host_costs"] = load_calibration(path)["host_costs"]
    except (ClusterError, KeyError, ValueError):
        pass
    return figures, save_calibration(figures, path)


def load_calibration(path: Path | None = None) -> dict:
    path = path or calibration_path()
    if not path.is_file():
        raise ClusterError(f"--cluster local needs this machine's figures: run `hybridflow plan --calibrate` first "
                           f"(it writes {path}; HYBRIDFLOW_CALIBRATION names another file)")
    figures = json.loads(path.read_text())
    missing = [k for k in ("fp32_flops", "bf16_flops", "memory_bandwidth", "gloo_latency_s", "gloo_bandwidth", "machine")
               if k not in figures]
    if missing:
        raise ClusterError(f"{path} lacks {missing}: run `hybridflow plan --calibrate` again")
    return figures


def local_cluster(processes: int, figures: dict | None = None) -> Cluster:
    """One node of ``processes`` CPU processes sharing this machine's cores and memory."""
    if processes < 1:
        raise ClusterError(f"--cluster local needs at least one process, got {processes}")
    figures = figures or load_calibration()
    cores = figures["machine"]["cores"]
    latency = figures.get("host_costs", {}).get("collective_latency_s", figures["gloo_latency_s"])
    share = 1 / processes  # each process runs cores / processes threads
    device = Accelerator(
        name=f"cpu-process({cores} cores/{processes})",
        memory_bytes=figures["machine"]["memory_bytes"] // processes,
        bf16_flops=figures["bf16_flops"] * share, fp32_flops=figures["fp32_flops"] * share,
        memory_bandwidth=figures["memory_bandwidth"] * share,
        link_bandwidth=figures["gloo_bandwidth"], network_bandwidth=figures["gloo_bandwidth"],
        link_latency=latency, network_latency=latency,
        source=f"measured by hybridflow plan --calibrate on {figures['machine']['cpu']} at {figures.get('measured_at')}",
        reserved_bytes=0, cores_per_device=cores * share, host_cores=float(cores),
        threads_per_device=max(1, cores // processes))
    return Cluster(1, processes, device)


def local_efficiency(figures: dict | None = None) -> Efficiency:
    """The planner's efficiencies on this machine: the defaults, the host costs fitted to measured runs
    when the calibration holds them (``tools/plan_vs_measured.py --fit``; zero until then), and vLLM's CPU LoRA
    kernels' share of a generation (``CPU_LORA_DECODE_OVERHEAD`` unless the calibration has its own)."""
    figures = figures or load_calibration()
    fitted = figures.get("host_costs", {})
    return Efficiency(**{name: float(fitted[name]) for name in HOST_COSTS if name in fitted},
                      lora_decode_overhead=float(figures.get("lora_decode_overhead", CPU_LORA_DECODE_OVERHEAD)))
