"""The one place that decides device and collective backend.

CUDA with NCCL where a GPU is visible, CPU with gloo otherwise. Nothing else
in the project names a device type or a backend; it asks this module.
"""

from __future__ import annotations

import os

import torch

__all__ = ["accelerator_available", "device_type", "dist_backend", "device_for_local_rank", "prepare_megatron", "DEVICE_ENV"]

# Set to "cpu" to force the CPU path on a machine that has a GPU.
DEVICE_ENV = "HYBRIDFLOW_DEVICE"


def accelerator_available() -> bool:
    if os.environ.get(DEVICE_ENV, "").lower() == "cpu":
        return False
    return torch.cuda.is_available()


def device_type() -> str:
    return "cuda" if accelerator_available() else "cpu"


def dist_backend() -> str:
    return "nccl" if accelerator_available() else "gloo"


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


def prepare_megatron() -> None:
    """Make megatron-core usable in this process and thread (a no-op with CUDA).

    On a CPU torch build this applies the compatibility patches once per
    process and enters the CUDA-to-CPU tensor-factory mode in the calling
    thread; call it in every thread that runs megatron code.
    """
    if accelerator_available():
        return
    from hybridengine.device import cpu_compat

    cpu_compat.install()
    cpu_compat.enter_thread()
