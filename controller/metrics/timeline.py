"""One step of a run as a Gantt chart: which pool ran which phase when, and how long each pool sat idle.

A trainer whose phases run on several resource pools, some at the same time,
logs for each phase that ran on a pool (seconds from the start of the step)::

    timing_s/phase/<pool>/<phase>/start
    timing_s/phase/<pool>/<phase>/end
    timing_s/idle/<pool>        seconds of the step in which the pool ran no phase
    timing_s/step               the step's wall time

``<pool>`` is a pool of the job's placement (``default``, ``actor``, ...) or
``driver`` for the controller's own work; neither it nor ``<phase>`` holds a
``/``. :func:`parse_timeline` turns one step record (``read_metrics``) into a
:class:`StepTimeline` without drawing anything; :func:`choose_record` picks the
step to draw; :func:`plot_timeline` writes ``timeline.png``: one row per pool,
one bar per phase coloured by phase, the x axis in seconds of the step, each
row annotated with the share of the step its pool was idle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DRIVER_POOL",
    "IDLE_PREFIX",
    "PHASE_PREFIX",
    "STEP_KEY",
    "StepTimeline",
    "busy_seconds",
    "choose_record",
    "has_phase_timings",
    "is_timeline_key",
    "parse_timeline",
    "plot_timeline",
]

PHASE_PREFIX = "timing_s/phase/"
IDLE_PREFIX = "timing_s/idle/"
STEP_KEY = "timing_s/step"
DRIVER_POOL = "driver"
# Phases in the order a PPO step runs them: their colours and legend order are fixed, whatever the run logs;
# phases of other names (registered roles) follow in order of first appearance.
KNOWN_PHASES = ("rollout", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")

Interval = tuple[str, float, float]  # phase, start, end (seconds from the start of the step)


@dataclass(frozen=True)
class StepTimeline:
    """What one step's record says about its pools.

    ``pools`` maps each pool to its phases as ``(phase, start, end)``, sorted by
    start; pools come in order of first appearance in the record, ``driver``
    last. A pool with a ``timing_s/idle/<pool>`` but no phase is there with no
    phases. ``idle_share`` is the share of the step (0..1) each pool ran no
    phase. ``step_s`` is ``timing_s/step``, or the latest phase end when the
    record lacks it.
    """

    step: int
    step_s: float
    pools: dict[str, list[Interval]]
    idle_share: dict[str, float]


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (a null, a bool, text, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def is_timeline_key(key: str) -> bool:
    """Whether ``key`` is drawn in the timeline (a per-phase start/end or a pool's idle time)."""
    return key.startswith((PHASE_PREFIX, IDLE_PREFIX))


def has_phase_timings(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` holds at least one phase with both its start and end (see :func:`parse_timeline`)."""
    return any(key.startswith(PHASE_PREFIX) for key in record) and parse_timeline(record) is not None


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: time overlapping phases are counted once."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def parse_timeline(record: Mapping[str, Any]) -> StepTimeline | None:
    """The pools' phases and idle shares of one step record; None when it has no phase timings.

    A phase is kept when both its ``start`` and ``end`` are finite numbers with
    ``end >= start``; other ``timing_s/phase/`` keys (a half-written pair, a
    null, a name with a ``/`` too many) are skipped. A pool's idle share is
    ``timing_s/idle/<pool>`` over the step's length when logged, else the step's
    length minus the union of its phases' intervals over the step's length;
    either is clipped to 0..1.
    """
    bounds: dict[str, dict[str, dict[str, float]]] = {}
    logged_idle: dict[str, float] = {}
    for key, value in record.items():
        number = _number(value)
        if number is None:
            continue
        if key.startswith(PHASE_PREFIX):
            parts = key[len(PHASE_PREFIX):].split("/")
            if len(parts) == 3 and parts[0] and parts[1] and parts[2] in ("start", "end"):
                pool, phase, edge = parts
                bounds.setdefault(pool, {}).setdefault(phase, {})[edge] = number
        elif key.startswith(IDLE_PREFIX):
            pool = key[len(IDLE_PREFIX):]
            if pool and "/" not in pool:
                logged_idle[pool] = number

    pools: dict[str, list[Interval]] = {}
    for pool, phases in bounds.items():
        intervals = [(phase, edges["start"], edges["end"]) for phase, edges in phases.items()
                     if "start" in edges and "end" in edges and edges["end"] >= edges["start"]]
        if intervals:
            pools[pool] = sorted(intervals, key=lambda item: (item[1], item[2]))
    if not pools:
        return None
    for pool in logged_idle:
        pools.setdefault(pool, [])
    if DRIVER_POOL in pools:
        pools[DRIVER_POOL] = pools.pop(DRIVER_POOL)

    logged_step = _number(record.get(STEP_KEY))
    step_s = logged_step if logged_step is not None and logged_step > 0 else \
        max(end for intervals in pools.values() for _, _, end in intervals)
    idle_share = {}
    for pool, intervals in pools.items():
        if step_s <= 0:
            share = 0.0
        elif pool in logged_idle:
            share = logged_idle[pool] / step_s
        else:
            share = (step_s - busy_seconds((start, end) for _, start, end in intervals)) / step_s
        idle_share[pool] = min(1.0, max(0.0, share))
    return StepTimeline(step=record["step"], step_s=step_s, pools=pools, idle_share=idle_share)


def _describe_steps(steps: Sequence[int]) -> str:
    """``[1, 2, 3, 5, 7, 8]`` as ``1-3, 5, 7-8``."""
    runs: list[list[int]] = []
    for step in sorted(set(steps)):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def choose_record(records: Sequence[Mapping[str, Any]], step: int | None = None) -> Mapping[str, Any] | None:
    """The record whose timeline is drawn: step ``step``, or by default the last one with phase timings.

    Without ``step``, None when no record has phase timings. A ``step`` not in
    ``records``, or one whose record has no phase timings, is a ValueError
    naming it and the steps there are (those with phase timings too). When a
    step was logged twice, its last record counts.
    """
    timed = [record for record in records if has_phase_timings(record)]
    if step is None:
        return timed[-1] if timed else None
    timed_steps = _describe_steps([record["step"] for record in timed]) if timed else "none"
    matches = [record for record in records if record["step"] == step]
    if not matches:
        logged = _describe_steps([record["step"] for record in records]) if records else "none"
        raise ValueError(f"step {step} is not in the run's metrics: steps logged: {logged}; "
                         f"steps with phase timings: {timed_steps}")
    if not has_phase_timings(matches[-1]):
        raise ValueError(f"step {step} has no phase timings ({PHASE_PREFIX}<pool>/<phase>/start|end) to draw; "
                         f"steps with phase timings: {timed_steps}")
    return matches[-1]


def _phase_colours(phases: Iterable[str]) -> dict[str, Any]:
    """A colour per phase: the known phases keep theirs across runs, others take the next free ones."""
    from matplotlib import colormaps

    palette = colormaps["tab20"].colors
    ordered = list(KNOWN_PHASES) + [phase for phase in dict.fromkeys(phases) if phase not in KNOWN_PHASES]
    # tab20 pairs a dark and a light shade; the dark ones first keep neighbours apart
    order = list(range(0, 20, 2)) + list(range(1, 20, 2))
    return {phase: palette[order[i % 20]] for i, phase in enumerate(ordered)}


def plot_timeline(timeline: StepTimeline, path: str | Path) -> Path:
    """Draw ``timeline`` as a Gantt chart into the PNG ``path`` (Agg canvas, no pyplot); returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    pools = list(timeline.pools)
    used = [phase for intervals in timeline.pools.values() for phase, _, _ in intervals]
    colours = _phase_colours(used)
    legend_phases = [phase for phase in colours if phase in used]

    fig = Figure(figsize=(9, 1.6 + 0.55 * len(pools)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for row, pool in enumerate(pools):
        for phase, start, end in timeline.pools[pool]:
            ax.barh(row, end - start, left=start, height=0.6, color=colours[phase], edgecolor="black", linewidth=0.5)
        ax.text(1.01, row, f"idle {timeline.idle_share[pool]:.0%}", transform=ax.get_yaxis_transform(),
                va="center", ha="left", fontsize="small")
    ax.set_yticks(range(len(pools)), pools)
    ax.set_ylim(len(pools) - 0.5, -0.5)  # first pool on top
    last_end = max((end for intervals in timeline.pools.values() for _, _, end in intervals), default=0.0)
    ax.set_xlim(0, max(timeline.step_s, last_end) * 1.02 or 1.0)  # a phase logged past the step's end shows whole
    ax.axvline(timeline.step_s, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds from the start of the step")
    ax.set_ylabel("pool")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    fig.legend(handles=[Patch(facecolor=colours[phase], edgecolor="black", label=phase) for phase in legend_phases],
               loc="outside lower center", ncol=min(len(legend_phases), 5), fontsize="small", frameon=False)
    fig.suptitle(f"step {timeline.step}: phases per pool, step time {timeline.step_s:.2f} s")
    fig.savefig(path, dpi=100, format="png")
    return path
