"""Ending a hybridflow process promptly once its work is done.

A process that has imported torch, megatron-core and vLLM spends seconds in
the interpreter's own teardown after its last line: torch unregisters every
operator a ``torch.library.Library`` defined (vLLM defines hundreds), then the
final garbage collections walk every module's objects. Nothing in that work
writes anything: outputs are closed by then. ``exit_process`` waits for the
threads that are not daemons and runs the ``atexit`` handlers, as the
interpreter would (Ray's shutdown, the torchrun runtime's, loggers', a
user's), without the operator unregistering, flushes the standard streams
and ends the process with ``os._exit``.

C++ static destructors do not run either: a library that cleans up in one
must be cleaned up by its owner before the end (vLLM's CPU shared memory,
workers/rollout/vllm_cpu_shm.py). ``HYBRIDFLOW_FAST_EXIT=0`` keeps the
interpreter's full teardown.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_process", "fast_exit_enabled"]


def fast_exit_enabled() -> bool:
    return os.environ.get("HYBRIDFLOW_FAST_EXIT", "1") != "0"


def _skip_operator_unregistering() -> None:
    """Turn off the exit-time finalizers of torch's operator libraries (the process is ending: nothing
    will call those operators again, and unregistering them one by one is most of the teardown)."""
    if "torch.library" not in sys.modules:  # torch was never imported: no library to unregister
        return
    from hybridengine.device.torch_compat import skip_operator_unregistering

    skip_operator_unregistering()


def exit_process(code: int) -> NoReturn:
    """End this process with ``code`` once its other threads that are not daemons end, after its
    ``atexit`` handlers and a flush of stdout and stderr, skipping the interpreter's teardown
    (``HYBRIDFLOW_FAST_EXIT=0``: ``sys.exit(code)`` instead). Call it from the main thread."""
    run_handlers = getattr(atexit, "_run_exitfuncs", None)  # what CPython's own exit path runs
    if not fast_exit_enabled() or run_handlers is None:
        sys.exit(code)
    for thread in threading.enumerate():  # as at a normal exit: a writer thread finishes its file
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    _skip_operator_unregistering()
    run_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code)
