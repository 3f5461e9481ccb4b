"""Every patch of torch, and every use of its private names (the guard: ``hybridengine.compat``).

The CPU path's emulation of ``torch.cuda``, which megatron-core needs on a
CPU-only torch build (gloo backend), is applied by
``workers.megatron.megatron_compat.prepare_megatron``:

emulate_cuda_on_cpu()  the process-wide patches (idempotent; a no-op when CUDA is available).
enter_thread()         enter the thread-local TorchFunctionMode in the calling thread. TorchFunctionModes
                       are per thread: call it in every thread that runs megatron code (idempotent per
                       thread; a no-op when CUDA is available).

The rest: ``defer_torch_compile`` (torch.compile resolves its backend at
first use), ``all_gather_single`` (the all-gather into one tensor under its
name in this torch), ``has_kernel_for`` (whether an op has a kernel for a
dispatch key) and ``skip_operator_unregistering`` (the exit-time finalizers
of torch's operator libraries turned off). ``TORCH.patches`` says why each
patch exists and when it can go.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from hybridengine.compat import LibraryShim, Patch

__all__ = [
    "TORCH",
    "all_gather_single",
    "cuda_to_cpu_mode",
    "defer_torch_compile",
    "emulate_cuda_on_cpu",
    "enter_thread",
    "has_kernel_for",
    "restore_timing_events",
    "skip_operator_unregistering",
]

TORCH = LibraryShim(
    "torch",
    distributions=("torch",),
    written_for=("2.13",),
    module=__name__,
    patches=[
        Patch("deferred_compile",
              why="megatron-core wraps its fusions in torch.compile at import, which imports dynamo and inductor "
                  "(2 s a process) for paths the CPU build never runs.",
              remove_when="torch.compile imports its backend lazily, or megatron-core stops compiling at import."),
        Patch("current_device",
              why="megatron-core allocates on torch.cuda.current_device() at ~200 sites, which raises on a CPU "
                  "build; it returns the CPU device instead.",
              remove_when="megatron-core takes its device from its caller instead of torch.cuda."),
        Patch("synchronize",
              why="megatron-core's p2p communication calls torch.cuda.synchronize() after batched send/recv; "
                  "gloo ops are already waited on, so it does nothing instead.",
              remove_when="megatron-core skips that call off CUDA."),
        Patch("wall_clock_events",
              why="megatron-core's static inference engine (and vLLM's CPU worker) time steps with "
                  "torch.cuda.Event, which a CPU build cannot create; a wall-clock event stands in.",
              remove_when="neither times with torch.cuda.Event off CUDA."),
        Patch("host_streams",
              why="megatron-core's all-to-all token dispatcher (mixtures of experts) copies its split sizes to "
                  "the host on a side torch.cuda.Stream and waits on an event it records; a CPU build has no "
                  "streams, so a stream that runs everything in program order stands in.",
              remove_when="megatron-core's token dispatcher skips its side stream off CUDA."),
        Patch("cuda_to_cpu_mode",
              why="megatron-core creates scratch tensors with a literal CUDA device, calls .cuda() on tied "
                  "embeddings and compares tensor.type() with CUDA names; a TorchFunctionMode maps them to CPU.",
              remove_when="megatron-core runs on a CPU build without them."),
        Patch("all_gather_single",
              why="torch renamed all_gather_into_tensor to all_gather_single (the old name is deprecated); "
                  "releases before the rename have only the old name, the fallback.",
              remove_when="every supported torch has all_gather_single: call it directly."),
        Patch("dispatch_key_query",
              why="torch has no public way to ask whether an op has a kernel for a dispatch key "
                  "(torch._C._dispatch_has_kernel_for_dispatch_key).",
              remove_when="torch offers a public query for it."),
        Patch("operator_library_finalizers",
              why="unregistering torch's operator libraries one by one at exit (torch.library._del_library "
                  "finalizers) is most of a process's teardown.",
              remove_when="torch skips that work at interpreter exit.",
              optional=True),
    ],
)
TORCH.check_version()

_emulating = False
_tls = threading.local()
_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TYPE = torch.Tensor.type


@TORCH.applies("deferred_compile")
def defer_torch_compile() -> None:
    """Make ``torch.compile(fn)`` look its backend up at ``fn``'s first call instead of at once (idempotent).

    A compiled function behaves as before; modules and other arguments go straight through.
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


def cuda_to_cpu_mode() -> TorchFunctionMode:
    """A fresh CUDA-to-CPU mode (see ``enter_thread``), for code that runs where the thread's mode is not
    in effect (autograd's backward)."""
    return _CudaToCpu()


@TORCH.applies("cuda_to_cpu_mode")
def enter_thread() -> None:
    """Enter the CUDA-to-CPU TorchFunctionMode in the calling thread, for its lifetime (a no-op with CUDA)."""
    if torch.cuda.is_available() or getattr(_tls, "mode", None) is not None:
        return
    _tls.mode = _CudaToCpu()
    _tls.mode.__enter__()  # kept for the thread's lifetime


@TORCH.applies("current_device")
def _current_device_is_cpu() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")


@TORCH.applies("synchronize")
def _synchronize_does_nothing() -> None:
    torch.cuda.synchronize = lambda device=None: None


def emulate_cuda_on_cpu() -> bool:
    """Apply the process-wide torch.cuda emulation once (the thread-local mode is ``enter_thread``'s).

    Returns False, having done nothing, when CUDA is available.
    """
    global _emulating
    if torch.cuda.is_available():
        return False
    if not _emulating:
        _emulating = True
        # ~200 sites allocate on / query torch.cuda.current_device(); without CUDA that
        # raises. Returning the CPU device makes those allocations land on CPU.
        _current_device_is_cpu()
        # p2p_communication calls torch.cuda.synchronize() after batched isend/irecv
        # (batch_p2p_sync=True, the default). gloo ops are waited on, so nothing to do.
        _synchronize_does_nothing()
        restore_timing_events()
        _streams_run_in_program_order()
    return True


class _HostStream:
    """A stream on a CPU build: work runs in program order, so waiting is done and events are at once.
    A class (it stands in for ``torch.cuda.Stream`` in annotations too, ``Stream | None``)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        event = event or _WallClockEvent()
        event.record(self)
        return event

    def __eq__(self, other) -> bool:  # one host stream: every stand-in is the same
        return isinstance(other, _HostStream)

    def __hash__(self) -> int:
        return 0


_HOST_STREAM = _HostStream()


@TORCH.applies("host_streams")
def _streams_run_in_program_order() -> None:
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


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


@TORCH.applies("wall_clock_events")
def restore_timing_events() -> None:
    """Put the wall-clock event in place of ``torch.cuda.Event`` (again, if an import replaced it; no-op with CUDA).

    vLLM's CPU worker installs its own stand-in, which cannot time; the
    wall-clock event answers vLLM's calls (record / wait / synchronize) too.
    """
    if not torch.cuda.is_available() and torch.cuda.Event is not _WallClockEvent:
        torch.cuda.Event = _WallClockEvent


_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@TORCH.applies("all_gather_single")
def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None, async_op: bool = False):
    """Every member's equal part of ``input_tensor`` into the flat ``output_tensor``, in group rank order."""
    return _ALL_GATHER_SINGLE(output_tensor, input_tensor, group=group, async_op=async_op)


@TORCH.applies("dispatch_key_query")
def has_kernel_for(op: str, dispatch_key: str) -> bool:
    """Whether the operator ``op`` ("namespace::name") has a kernel registered for ``dispatch_key`` ("CUDA")."""
    query = TORCH.require(torch._C, "_dispatch_has_kernel_for_dispatch_key", patch="dispatch_key_query")
    return query(op, dispatch_key)


@TORCH.applies("operator_library_finalizers")
def skip_operator_unregistering() -> None:
    """Turn off the exit-time finalizers of torch's operator libraries (the process is ending: nothing
    will call those operators again). Call it only once the process is ending."""
    library = sys.modules.get("torch.library")
    if library is None:  # never imported: no library to unregister
        return
    deregister = TORCH.optional(library, "_del_library", patch="operator_library_finalizers")
    if deregister is None:
        return
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        info = finalizer.peek()
        if info is not None and info[1] is deregister:
            finalizer.atexit = False
