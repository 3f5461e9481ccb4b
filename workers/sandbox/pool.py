"""Many sandboxed programs at once, at most ``max_workers`` running: ``run_many`` and ``Sandbox``.

::

    results = run_many(["print(1)", {"code": "print(input())", "stdin": "x"}], max_workers=4)

    with Sandbox(SandboxLimits(timeout=2), max_workers=8) as box:
        box.run("print(1)")
        box.run_many(programs)                   # in the programs' order
        await box.arun("print(1)")               # from a coroutine: waits without blocking the event loop

Each program is a string (the code) or a mapping of ``run``'s keyword
arguments (``code``, ``stdin``, ``files``, ``timeout``, ``memory``,
``language``). Every program runs in its own sandbox process; the bound is
on how many run at once (threads of a pool, each waiting on one program),
shared by ``run``, ``run_many`` and ``arun`` of one ``Sandbox``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workers.sandbox.limits import SandboxLimits
from workers.sandbox.result import SandboxResult
from workers.sandbox.runner import run

__all__ = ["Sandbox", "run_many"]

_PROGRAM_KEYS = ("code", "language", "stdin", "timeout", "memory", "files")


def _program_kwargs(program: Any, index: int) -> dict[str, Any]:
    if isinstance(program, str):
        return {"code": program}
    if isinstance(program, Mapping):
        unknown = sorted(set(program) - set(_PROGRAM_KEYS))
        if unknown or "code" not in program:
            raise ValueError(f"program {index}: a mapping needs 'code' and may have {list(_PROGRAM_KEYS[1:])}"
                             + (f"; unknown keys {unknown}" if unknown else ""))
        return dict(program)
    raise ValueError(f"program {index} must be a str (the code) or a mapping of run()'s arguments, "
                     f"got {type(program).__name__}")


class Sandbox:
    """Shared limits and isolation, and a pool running at most ``max_workers`` programs at once."""

    def __init__(self, limits: SandboxLimits | None = None, max_workers: int = 4, isolation: str | None = None) -> None:
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be a positive integer, got {max_workers!r}")
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        self.limits = limits or SandboxLimits()
        self.max_workers = max_workers
        self.isolation = isolation
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix="hybridflow-sandbox")
            return self._executor

    def _call(self, kwargs: dict[str, Any]) -> SandboxResult:
        return run(**kwargs, limits=self.limits, isolation=self.isolation)

    def run(self, code: str, **kwargs: Any) -> SandboxResult:
        """One program, in a pool slot (waits for one when all ``max_workers`` are busy)."""
        return self._pool().submit(self._call, _program_kwargs({"code": code, **kwargs}, 0)).result()

    def run_many(self, programs: Iterable[str | Mapping[str, Any]]) -> list[SandboxResult]:
        """Every program, at most ``max_workers`` at once; results in the programs' order.

        All programs are checked before any runs (ValueError naming the first bad one).
        """
        calls = [_program_kwargs(program, i) for i, program in enumerate(programs)]
        pool = self._pool()
        return [future.result() for future in [pool.submit(self._call, kwargs) for kwargs in calls]]

    async def arun(self, code: str, **kwargs: Any) -> SandboxResult:
        """``run`` from a coroutine: the program runs on the pool, the event loop stays free."""
        call = _program_kwargs({"code": code, **kwargs}, 0)
        return await asyncio.wrap_future(self._pool().submit(self._call, call))

    def close(self) -> None:
        """Wait for the running programs, then stop the pool's threads (a later call starts a new pool)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sandbox(max_workers={self.max_workers}, isolation={self.isolation!r}, limits={self.limits})"


def run_many(programs: Iterable[str | Mapping[str, Any]], max_workers: int = 4, limits: SandboxLimits | None = None,
             isolation: str | None = None) -> list[SandboxResult]:
    """Run every program (code strings or mappings of ``run``'s arguments), at most ``max_workers`` at once."""
    with Sandbox(limits, max_workers, isolation) as box:
        return box.run_many(programs)
