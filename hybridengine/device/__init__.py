"""The one place that decides device and collective backend.

CUDA with NCCL where a GPU is visible, CPU with gloo otherwise. Nothing else
in the project names a device type or a backend; it asks this module.
``torch_compat`` holds torch's patches, the CPU path's emulation of
``torch.cuda`` among them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = [
    "accelerator_properties",
    "host_memory_bytes",
    "accelerator_available",
    "accelerator_count",
    "device_type",
    "dist_backend",
    "device_for_local_rank",
    "compute_device",
    "reset_peak_memory",
    "peak_memory",
    "current_memory",
    "device_memory_bytes",
    "use_device",
    "DEVICE_ENV",
    "kernel_devices",
    "synchronize",
    "standalone_process_group",
    "CollectiveProfile",
    "collective_profile",
    "PROFILE_ENV",
    "defer_compile_on_cpu",
]

# Set to "cpu" to force the CPU path on a machine that has a GPU.
DEVICE_ENV = "HYBRIDFLOW_DEVICE"


def accelerator_available() -> bool:
    if os.environ.get(DEVICE_ENV, "").lower() == "cpu":
        return False
    return torch.cuda.is_available()


def accelerator_count() -> int:
    """GPUs this process may use (0 on the CPU path)."""
    return torch.cuda.device_count() if accelerator_available() else 0


def device_type() -> str:
    return "cuda" if accelerator_available() else "cpu"


def dist_backend() -> str:
    return "nccl" if accelerator_available() else "gloo"


def standalone_process_group(host: str, port: int, rank: int, size: int, timeout_s: float, name: str):
    """A process group of its own, outside this process's torch.distributed world (NCCL or gloo).

    For ranks of different worlds (a Ray pool is a world of its own) that must talk, such as the
    actor's and a separate rollout pool's: they meet at the TCP store at ``host:port`` (hosted by
    whoever calls ``TCPStore(..., is_master=True)``), under the key prefix ``name``. The group is
    used through its own ``send`` / ``recv``; torch.distributed's functions do not know it.
    """
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(f"{name}/", dist.TCPStore(host, port, is_master=False, timeout=timeout))
    if accelerator_available():
        return dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, size, timeout)


@dataclass(frozen=True)
class CollectiveProfile:
    """What one collective costs on this backend: the cost model that sizes resharding's buckets.

    ``latency_s``: the fixed cost of one collective; ``link_bytes_per_s``: the
    bytes a rank receives per second within a collective; ``copy_bytes_per_s``:
    a local copy's speed (what laying bytes out costs).
    """

    latency_s: float
    link_bytes_per_s: float
    copy_bytes_per_s: float


# Defaults: gloo between processes of one host, as measured on this project's 2-core CI machine
# (tools/bench_reshard.py --measure-link); NCCL over NVLink inside one node.
_CPU_PROFILE = CollectiveProfile(latency_s=2.5e-3, link_bytes_per_s=2e9, copy_bytes_per_s=2e9)
_GPU_PROFILE = CollectiveProfile(latency_s=30e-6, link_bytes_per_s=150e9, copy_bytes_per_s=1.5e12)
# "latency_s,link_bytes_per_s,copy_bytes_per_s" overrides the default (e.g. "20e-6,25e9,1e12" across nodes).
PROFILE_ENV = "HYBRIDFLOW_COLLECTIVE_PROFILE"


def collective_profile() -> CollectiveProfile:
    """The configured cost model: ``HYBRIDFLOW_COLLECTIVE_PROFILE`` if set, else this backend's default."""
    text = os.environ.get(PROFILE_ENV, "").strip()
    if not text:
        return _GPU_PROFILE if accelerator_available() else _CPU_PROFILE
    try:
        latency, link, copy = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{PROFILE_ENV}={text!r}: expected three numbers 'latency_s,link_bytes_per_s,"
                         f"copy_bytes_per_s', e.g. '2.5e-3,2e9,2e9'") from None
    if min(latency, link, copy) <= 0:
        raise ValueError(f"{PROFILE_ENV}={text!r}: every figure must be positive")
    return CollectiveProfile(latency, link, copy)


def defer_compile_on_cpu() -> None:
    """On the CPU path, torch.compile resolves its backend at first use (see torch_compat.defer_torch_compile):
    importing megatron-core then skips inductor, about two seconds per process. A no-op with CUDA."""
    if not accelerator_available():
        from hybridengine.device import torch_compat

        torch_compat.defer_torch_compile()


def kernel_devices() -> list[torch.device]:
    """Every device this process can run the op library on: the CPU, and the GPU when one is visible.

    Unlike ``accelerator_available`` this ignores DEVICE_ENV: kernel tests and
    benchmarks cover each device present even while training is held to CPU.
    """
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    return devices


def device_for_local_rank(local_rank: int) -> torch.device:
    """The device a process with this local rank computes on.

    Under Ray each GPU actor sees only its own GPU (index 0); under torchrun
    every process sees all GPUs of its node and takes the one at its local
    rank, so the modulo covers both.
    """
    if not accelerator_available():
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def compute_device() -> torch.device:
    """The device this process computes on now: its current GPU (set by ``device_for_local_rank`` or
    ``use_device``), or the CPU. Where a built model is moved: megatron creates its own layers' weights
    there, but torch modules inside them (the local spec's norms) start on the CPU."""
    if not accelerator_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _on_accelerator(device: torch.device | None) -> bool:
    return accelerator_available() if device is None else device.type != "cpu"


def synchronize(device: torch.device | None = None) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU)."""
    if _on_accelerator(device):
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device | None = None) -> int:
    """Start a new peak-memory window on ``device`` (default: this process's device); returns the bytes in use now.

    On GPU this is the caching allocator's count. On CPU it is the process's
    resident set (Linux: VmHWM is reset through /proc/self/clear_refs), which
    follows allocations closely when glibc's mmap threshold is fixed
    (MALLOC_MMAP_THRESHOLD_), as the benchmarks set it.
    """
    if _on_accelerator(device):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status_bytes("VmRSS")


def current_memory(device: torch.device | None = None) -> int:
    """Bytes in use now, counted as ``reset_peak_memory`` counts them."""
    if _on_accelerator(device):
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return _proc_status_bytes("VmRSS")


def peak_memory(device: torch.device | None = None) -> int:
    """Peak bytes in use since the last ``reset_peak_memory``."""
    if _on_accelerator(device):
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _proc_status_bytes("VmHWM")


def use_device(index: int) -> None:
    """Make GPU ``index`` this process's current device (a placed DataFlow node's ``cuda:N``)."""
    count = accelerator_count()
    if index >= count:
        raise ValueError(f"device cuda:{index} is not on this machine; it has {count} GPU(s)")
    torch.cuda.set_device(index)


def accelerator_properties(index: int = 0) -> tuple[str, int]:
    """(name, memory in bytes) of GPU ``index``, as the runtime reports them."""
    props = torch.cuda.get_device_properties(index)
    return props.name, int(props.total_memory)


def host_memory_bytes() -> int:
    """The machine's RAM (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal")


def device_memory_bytes() -> int:
    """One device's memory: the first GPU's, or on the CPU path the machine's RAM (MemTotal)."""
    return accelerator_properties(0)[1] if accelerator_available() else host_memory_bytes()


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")
