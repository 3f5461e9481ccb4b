"""The step's phases as a dataflow over pools: each phase says what it reads and writes and which pool it
runs on; a phase starts as soon as what it reads is written and its pool is free.

    phases = [Phase("old_log_prob", "default", reads=("responses",), writes=("old_log_probs",), run=old),
              Phase("values", "critic", reads=("responses",), writes=("values",), run=values)]
    out = PhaseFlow(overlap=True).run(phases, state, ready=("responses",))
    out["values"]  # each phase's result, by phase name

- Phases on disjoint pools run at the same time, each on a thread of the controller's that waits for its
  worker group's call (the work itself runs in the pools' processes; ``"driver"`` is the controller's own).
- Phases on one pool take turns, in the order given: the order the sequential step always used, so
  that each pool sees its calls in the same order (collectives inside worker methods line up).
- The results come back by name and the caller joins them in its own order, so a step's batch and
  metrics do not depend on which phase ended first: concurrency changes wall time only.
- ``overlap=False`` runs the phases one after another on the calling thread, in the order given.

Every phase's start and end, on its pool, go into ``state`` (``StepState.phases``): the timeline that
``timing_s/phase/<pool>/<phase>/start|end`` and ``timing_s/idle/<pool>`` report.

A phase that raises stops the flow: no further phase starts, those running are waited for, and the first
error is raised as it was (a worker's death stays a ``WorkerDiedError`` for the job's restarts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from controller.algorithms.algorithm import StepState

__all__ = ["DRIVER", "Phase", "PhaseFlow"]

DRIVER = "driver"  # the pool name of work the controller does itself (the advantages)


@dataclass(frozen=True)
class Phase:
    """One phase of the step: ``run()`` on ``pool``, after what it ``reads`` is written."""

    name: str
    pool: str
    run: Callable[[], Any]
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()


class PhaseFlow:
    """Runs a list of phases by their data and their pools (see the module docstring)."""

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap

    def run(self, phases: Sequence[Phase], state: StepState | None = None, ready: Iterable[str] = ()) -> dict[str, Any]:
        """Each phase's result, by name. ``ready``: what is written before the first phase (the batch)."""
        check_phases(phases, ready)
        if not self.overlap or len(phases) < 2:
            return {phase.name: _timed(phase, state) for phase in phases}
        written, results = set(ready), {}
        waiting, running = list(phases), {}  # future -> phase
        failure: BaseException | None = None
        with ThreadPoolExecutor(max_workers=len(phases), thread_name_prefix="hybridflow-phase") as threads:
            while waiting or running:
                busy = {phase.pool for phase in running.values()}
                for phase in startable(waiting, written, busy) if failure is None else []:
                    waiting.remove(phase)
                    busy.add(phase.pool)
                    running[threads.submit(_timed, phase, state)] = phase
                if not running:
                    break  # a failure: what is left does not start
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    phase = running.pop(future)
                    try:
                        results[phase.name] = future.result()
                    except BaseException as exc:  # noqa: BLE001 (raised once the running ones are done)
                        failure = failure or exc
                        continue
                    written.update(phase.writes)
        if failure is not None:
            raise failure
        return results


def startable(waiting: Sequence[Phase], written: set[str], busy: set[str]) -> list[Phase]:
    """The waiting phases that may start now: what each reads is written, its pool runs nothing, and no phase
    before it on its pool is still waiting (a shared pool keeps the given order)."""
    out, passed = [], set()
    for phase in waiting:
        if phase.pool not in busy and phase.pool not in passed and written.issuperset(phase.reads):
            out.append(phase)
            busy = busy | {phase.pool}
        passed.add(phase.pool)
    return out


def check_phases(phases: Sequence[Phase], ready: Iterable[str]) -> None:
    """ValueError for a phase named twice, or one that reads what neither ``ready`` nor an earlier phase
    writes (the flow would wait for it forever)."""
    written, names = set(ready), set()
    for phase in phases:
        if phase.name in names:
            raise ValueError(f"phase {phase.name!r} is listed twice")
        names.add(phase.name)
        missing = [r for r in phase.reads if r not in written]
        if missing:
            raise ValueError(f"phase {phase.name!r} reads {missing}, which no earlier phase writes (written: "
                             f"{sorted(written)})")
        written.update(phase.writes)


def _timed(phase: Phase, state: StepState | None) -> Any:
    if state is None:
        return phase.run()
    with state.timed(phase.name, pool=phase.pool):
        return phase.run()
