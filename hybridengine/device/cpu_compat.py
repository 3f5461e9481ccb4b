"""Run megatron-core 0.16.1 on a CPU-only torch build (gloo backend).

install()       process-wide patches (idempotent; no-op when CUDA is available).
                Call it before model_parallel_cuda_manual_seed and model building.
enter_thread()  enter the thread-local TorchFunctionMode in the calling thread.
                TorchFunctionModes are per thread: install() enters it for the
                calling thread; call enter_thread() in every other thread that runs
                megatron code (idempotent per thread).

The caller still builds megatron the CPU way: use_cpu_initialization=True, the
local layer spec (no transformer-engine), bias_dropout_fusion /
bias_activation_fusion / masked_softmax_fusion off (fused paths need torch.compile
or CUDA kernels), gradient_accumulation_fusion off.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import time

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install", "enter_thread", "defer_torch_compile"]

_installed = False
_tls = threading.local()
_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TYPE = torch.Tensor.type


def defer_torch_compile() -> None:
    """Make ``torch.compile(fn)`` look its backend up at ``fn``'s first call instead of at once (idempotent).

    megatron-core decorates its fusions with torch.compile when it is imported, which imports dynamo and
    inductor: two seconds in every worker process. On CPU those fused paths are off, so the import is
    all they cost. A compiled function behaves as before; modules and other arguments go straight through.
    """
    if getattr(torch.compile, "_hybridflow_deferred", False):
        return
    compile_now = torch.compile

    def compile_later(model=None, **kwargs):
        if model is None:  # @torch.compile(...) with options: a decorator
            return lambda fn: compile_later(fn, **kwargs)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return compile_now(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **kwargs)
            return compiled(*args, **kw)

        return first_call_compiles

    compile_later._hybridflow_deferred = True
    torch.compile = compile_later


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _TENSOR_CUDA:
            # With tied embeddings and PP > 1 the last stage's copy of the
            # embedding is moved with .cuda() before its first all-reduce; it
            # already lives where everything else does.
            return args[0]
        if kwargs:
            # Schedules (token count), the default causal mask, the optimizer and
            # grad clipping create small scratch tensors with a literal
            # device="cuda"; creating them on CPU, where everything else is, is exact.
            if _is_cuda(kwargs.get("device")):
                kwargs = {**kwargs, "device": "cpu"}
        elif func is _TENSOR_TYPE and len(args) == 1:
            # Grad clipping asserts grad.type() == 'torch.cuda.FloatTensor' and the
            # (distributed) optimizer picks its fp32 / fp16 branch by those names.
            # Report the CUDA spelling for the same dtype; only the zero-arg name
            # query is touched, never the conversion form .type(dtype).
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **(kwargs or {}))


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
    _allow_torch_norm_with_sequence_parallel()
    _cpu_rng_tracker()
    _static_inference_on_host()
    enter_thread()


def _allow_torch_norm_with_sequence_parallel() -> None:
    # Without apex the local spec uses WrappedTorchNorm, which asserts
    # not sequence_parallel. A norm is per token, so running it on the sequence
    # shard is exact; only its weight grad is partial per TP rank. Mark the
    # weights `sequence_parallel` (as megatron's FusedLayerNorm does) so
    # finalize_model_grads all-reduces them over the TP group.
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    orig_new = WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return orig_new(cls, config, hidden_size, eps, **kwargs)
        config = copy.copy(config)
        config.sequence_parallel = False
        norm = orig_new(cls, config, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(new)


def _cpu_rng_tracker() -> None:
    # model_parallel_cuda_manual_seed(seed) builds a CudaRNGStatesTracker, whose
    # add()/fork() read and write the CUDA generator. On CPU, dropout draws from
    # the default CPU generator, so keep the named states (data-, model- and
    # expert-parallel) as CPU generator states and swap them in on fork().
    # initialize_rng_tracker looks the class up by name at call time, and the
    # inference tracker subclasses it (its no-op overrides still apply).
    from megatron.core.tensor_parallel import random

    class CpuRNGStatesTracker(random.CudaRNGStatesTracker):
        def add(self, name, seed):
            if seed in self.seeds_ or name in self.states_:
                raise Exception(f"rng state {name} / seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    random.CudaRNGStatesTracker = CpuRNGStatesTracker
    # Activation recomputation (CheckpointFunction) saves and restores the CPU generator, the tracker's
    # states and the CUDA generator around each recomputed block. There is no CUDA generator here, and
    # everything draws from the other two, so its state is empty and restoring it does nothing.
    random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.empty(0, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: None
    # The recomputed forward runs inside autograd's backward, where the thread's TorchFunctionMode is not
    # in effect: enter one for it.
    recompute_backward = random.CheckpointFunction.backward

    def backward(ctx, *grads):
        with _CudaToCpu():
            return recompute_backward(ctx, *grads)

    random.CheckpointFunction.backward = staticmethod(backward)


class _WallClockEvent:
    """A wall-clock stand-in for a CUDA timing event: record / synchronize / query / elapsed_time (ms)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._t = None

    def record(self, stream=None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, end: "_WallClockEvent") -> float:
        return (end._t - self._t) * 1000.0


def restore_timing_events() -> None:
    """Put the wall-clock event back if an import replaced ``torch.cuda.Event`` since ``install``.

    vLLM's CPU worker installs its own stand-in, which cannot time; the
    wall-clock event answers vLLM's calls (record / wait / synchronize) too.
    """
    if not torch.cuda.is_available() and torch.cuda.Event is not _WallClockEvent:
        torch.cuda.Event = _WallClockEvent


def _static_inference_on_host() -> None:
    # The static inference engine's text generation controller times every
    # decode step with torch.cuda.Event, which a CPU-only build cannot create;
    # and its pipeline logits broadcast asserts the tensor is a CUDA tensor
    # (the broadcast itself works on gloo). Time on the wall clock; accept CPU tensors.
    from megatron.core.inference import communication_utils

    restore_timing_events()

    def _is_on_device(tensor):
        assert tensor is not None

    communication_utils._is_cuda = _is_on_device
