"""Run megatron-core 0.16.1 on a CPU-only torch build (gloo backend).

install()       process-wide patches (idempotent; no-op when CUDA is available).
enter_thread()  enter the thread-local TorchFunctionMode in the calling thread.
                TorchFunctionModes are per thread: call it in every process AND
                every thread that runs megatron code (idempotent per thread).

The caller still builds megatron the CPU way: use_cpu_initialization=True,
a local (non transformer-engine) layer spec, bias_dropout_fusion /
bias_activation_fusion off (they go through torch.compile), and
model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True) when dropout is 0.
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install", "enter_thread"]

_installed = False
_tls = threading.local()


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Schedules (token count), the default causal mask, the optimizer and grad
        # clipping create small tensors with a literal device="cuda"; they are only
        # scratch values, so making them on CPU changes nothing else.
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        # Grad clipping asserts grad.type() == 'torch.cuda.FloatTensor' and the
        # (distributed) optimizer picks fp32/fp16 handling by those names; report
        # the CUDA spelling so the same dtype branch is taken. Only the zero-arg
        # form (a name query) is touched, never the conversion form.
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def enter_thread() -> None:
    if torch.cuda.is_available() or getattr(_tls, "mode", None) is not None:
        return
    _tls.mode = _CudaToCpu()
    _tls.mode.__enter__()  # kept for the thread's lifetime


def install() -> None:
    global _installed
    if _installed or torch.cuda.is_available():
        return
    _installed = True
    # ~200 sites allocate on / query torch.cuda.current_device(); without CUDA that
    # raises. Returning the CPU device makes those allocations land on CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # p2p_communication calls torch.cuda.synchronize() after batched isend/irecv
    # (batch_p2p_sync=True, the default). gloo ops are waited on, so nothing to do.
    torch.cuda.synchronize = lambda device=None: None
    enter_thread()
