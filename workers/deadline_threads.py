"""DeadlineThreads: calls that may never return (user code: tools, reward functions), each on a daemon thread
of its own, at most ``max_threads`` at once, each awaited until its deadline.

::

    threads = DeadlineThreads(max_threads=8, name="hybridflow-reward")
    future = threads.submit(fn, arg, timeout_s=30.0)   # None: every thread is held by a call past its deadline
    future.result(timeout=...)                           # the caller waits until the call's deadline

A Python call cannot be killed: one that overruns keeps its thread until it returns by itself. Daemon threads
never hold the process at exit (a thread pool's would). What an overrun call does to the bound:

- ``max_abandoned=None`` (tools): it keeps its slot. So that hung calls cannot block everything behind them,
  ``submit`` waits for a free slot only while some running call is still within its deadline; when every
  slot is held by an overrun call it returns None at once, and the caller reports a timeout.
- ``max_abandoned=N`` (rewards): it gives its slot up and its thread is abandoned, so later calls still run
  ``max_threads`` at once; once more than N abandoned threads are still running, ``submit`` raises (a
  function that hangs on everything is an error, not an endless stream of timeouts).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["DeadlineThreads"]


class DeadlineThreads:
    def __init__(self, max_threads: int, name: str = "hybridflow-call", max_abandoned: int | None = None) -> None:
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            raise ValueError(f"max_threads must be a positive integer, got {max_threads!r}")
        self.max_threads, self.name, self.max_abandoned = max_threads, name, max_abandoned
        self._lock = threading.Condition()
        self._running: dict[Future, float] = {}  # call on a thread -> its deadline (monotonic)
        self._closed = False

    @property
    def hung(self) -> int:
        """Threads still held by calls past their deadline (they end when the call returns)."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for future, deadline in self._running.items() if deadline <= now and not future.done())

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Future | None:
        """``fn(*args)`` on a new daemon thread, its deadline ``timeout_s`` from now; None when every thread is
        held by a call past its deadline (nothing started). RuntimeError once closed."""
        future: Future = Future()
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                live = [deadline for deadline in self._running.values() if deadline > now]
                if self.max_abandoned is not None:
                    abandoned = len(self._running) - len(live)
                    if abandoned > self.max_abandoned:
                        raise RuntimeError(f"{abandoned} {self.name} calls passed their deadline and never returned "
                                           f"(more than {self.max_abandoned}): the function hangs")
                    if len(live) < self.max_threads:
                        break
                elif len(self._running) < self.max_threads:
                    break
                elif not live:
                    return None
                # A slot frees when its call returns (notify) or its deadline passes.
                self._lock.wait(timeout=min(live) - now + 1e-3)
            if self._closed:
                raise RuntimeError(f"these {self.name} threads are closed")
            self._running[future] = time.monotonic() + timeout_s
        future.add_done_callback(self._release)

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(exc)

        threading.Thread(target=run, name=self.name, daemon=True).start()
        return future

    def close(self) -> None:
        """Refuse new calls; threads held by running calls end when those return."""
        with self._lock:
            self._closed = True

    def _release(self, future: Future) -> None:
        with self._lock:
            self._running.pop(future, None)
            self._lock.notify_all()
