"""Ending a hybridflow process promptly once its work is done.

A process that has imported torch, megatron-core and vLLM spends seconds in
the interpreter's own teardown after its last line: torch unregisters every
operator a ``torch.library.Library`` defined (vLLM defines hundreds), then the
final garbage collections walk every module's objects. Nothing in that work
writes anything: outputs are closed by then. ``exit_process`` does what the
interpreter's exit does for the process's outputs, in its order, without the
operator unregistering:

1. the ``threading._register_atexit`` hooks. ``concurrent.futures`` registers
   one that tells every thread pool's idle workers to leave; until it runs, an
   idle worker of a pool that something still references waits for work
   forever, and joining it would never return;
2. a join of the threads that are not daemons (a writer thread finishes its
   file), bounded: one still running after ``HYBRIDFLOW_EXIT_JOIN_S`` seconds
   (default 10) is named on stderr with its stack, and the process ends
   anyway, so no library's thread can keep a finished job alive;
3. the ``atexit`` handlers (Ray's shutdown, the torchrun runtime's, loggers',
   a user's), then a flush of the standard streams and ``os._exit``.

C++ static destructors do not run: a library that cleans up in one must be
cleaned up by its owner before the end (vLLM's CPU shared memory,
workers/rollout/vllm_cpu_shm.py). ``HYBRIDFLOW_FAST_EXIT=0`` keeps the
interpreter's full teardown, unbounded join included.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from typing import NoReturn

__all__ = ["exit_process", "fast_exit_enabled", "join_bound_s"]

DEFAULT_JOIN_BOUND_S = 10.0


def fast_exit_enabled() -> bool:
    return os.environ.get("HYBRIDFLOW_FAST_EXIT", "1") != "0"


def join_bound_s() -> float:
    """How long the end waits for threads that are not daemons (``HYBRIDFLOW_EXIT_JOIN_S``)."""
    value = os.environ.get("HYBRIDFLOW_EXIT_JOIN_S", "")
    try:
        bound = float(value) if value else DEFAULT_JOIN_BOUND_S
    except ValueError:
        raise ValueError(f"HYBRIDFLOW_EXIT_JOIN_S={value!r} must be a number of seconds >= 0") from None
    if bound < 0:
        raise ValueError(f"HYBRIDFLOW_EXIT_JOIN_S={value!r} must be a number of seconds >= 0")
    return bound


def _skip_operator_unregistering() -> None:
    """Turn off the exit-time finalizers of torch's operator libraries (the process is ending: nothing
    will call those operators again, and unregistering them one by one is most of the teardown)."""
    if "torch.library" not in sys.modules:  # torch was never imported: no library to unregister
        return
    from hybridengine.device.torch_compat import skip_operator_unregistering

    skip_operator_unregistering()


def _threads_to_wait_for(caller: threading.Thread) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t is not caller and t is not threading.current_thread() and not t.daemon]


def _finish_threads(caller: threading.Thread) -> None:
    """The first half of CPython's ``threading._shutdown``: its hooks, newest first, then the join."""
    for hook in reversed(list(getattr(threading, "_threading_atexits", ()))):
        try:
            hook()
        except Exception:  # a hook that fails must not stop the others (the interpreter would print it too)
            traceback.print_exc()
    while threads := _threads_to_wait_for(caller):  # a thread may start another before it ends
        for thread in threads:
            thread.join()


def _report_stragglers(caller: threading.Thread, bound_s: float) -> None:
    frames = sys._current_frames()
    lines = []
    for thread in _threads_to_wait_for(caller):
        stack = "".join(traceback.format_stack(frames[thread.ident])) if thread.ident in frames else "  (no stack)\n"
        lines.append(f"[hybridflow] exit: thread {thread.name!r} (not a daemon) still running after {bound_s:g} s; "
                     f"the process ends without it (HYBRIDFLOW_EXIT_JOIN_S sets the wait). Its stack:\n{stack}")
    if lines:
        sys.stderr.write("".join(lines))


def exit_process(code: int) -> NoReturn:
    """End this process with ``code`` once its threads that are not daemons end (at most
    ``HYBRIDFLOW_EXIT_JOIN_S`` seconds, after telling thread pools to stop), after its ``atexit`` handlers and
    a flush of stdout and stderr, skipping the interpreter's teardown (``HYBRIDFLOW_FAST_EXIT=0``:
    ``sys.exit(code)`` instead). Call it from the main thread."""
    run_handlers = getattr(atexit, "_run_exitfuncs", None)  # what CPython's own exit path runs
    if not fast_exit_enabled() or run_handlers is None:
        sys.exit(code)
    bound_s = join_bound_s()
    caller = threading.current_thread()
    # The hooks and joins run on a daemon thread so that a thread that never ends (or a pool's worker busy in a
    # task that never returns, which concurrent.futures' own hook joins) costs the bound, not the process.
    finisher = threading.Thread(target=_finish_threads, args=(caller,), name="hybridflow-exit", daemon=True)
    finisher.start()
    finisher.join(bound_s)
    if finisher.is_alive():
        _report_stragglers(caller, bound_s)
    _skip_operator_unregistering()
    run_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code)
