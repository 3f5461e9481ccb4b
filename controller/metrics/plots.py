"""PNG line charts of a run's ``metrics.jsonl``, drawn without a display.

Figures are drawn on matplotlib's Agg canvas directly (``Figure`` plus
``FigureCanvasAgg``), never through ``pyplot``, so no window system is needed
and the process-wide matplotlib backend is left untouched.

The default set, each written only when at least one of its metrics has a value:

``reward.png``           ``critic/score/mean``, ``critic/rewards/mean``, ``val/reward/mean`` on one axis
``losses.png``           every ``actor/*loss`` and ``critic/*loss`` except the KL terms (kl.png), one panel each
``kl.png``               ``actor/ppo_kl``, ``actor/reward_kl_penalty``, ``actor/kl_loss``, a teacher's
                         ``actor/opd/reverse_kl`` and ``actor/teacher_kl_loss``, one panel each
``timing.png``           every ``timing_s/*`` on one axis, except the per-phase and idle times below
``timeline.png``         one step's phases per pool as a Gantt chart (``controller/metrics/timeline.py``):
                         ``timing_s/phase/<pool>/<phase>/start|end`` and ``timing_s/idle/<pool>``
``response_length.png``  ``response_length/mean``, ``/max``, ``/min`` on one axis

Series with enough points also get a trailing rolling mean drawn over the raw
curve. Steps whose value is ``null`` (a NaN or inf when logged) leave a gap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from controller.metrics.log import METRICS_FILE, read_metrics
from controller.metrics.timeline import choose_record, is_timeline_key, parse_timeline, plot_timeline

__all__ = ["PLOTS_DIR", "plot_run"]

PLOTS_DIR = "plots"
REWARD_KEYS = ("critic/score/mean", "critic/rewards/mean", "val/reward/mean")
KL_KEYS = ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss", "actor/opd/reverse_kl", "actor/teacher_kl_loss")
RESPONSE_LENGTH_KEYS = ("response_length/mean", "response_length/max", "response_length/min")

Series = tuple[np.ndarray, np.ndarray]  # steps, values (NaN where a step has no value)


def _series(records: list[dict[str, Any]], key: str) -> Series | None:
    """Steps and values of ``key`` over the records that have it; None when it never has a numeric value."""
    steps, values = [], []
    for record in records:
        if key not in record:
            continue
        value = record[key]
        if value is None:
            values.append(math.nan)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values.append(float(value))
        else:
            continue
        steps.append(record["step"])
    array = np.asarray(values, dtype=float)
    if not np.isfinite(array).any():
        return None
    return np.asarray(steps, dtype=float), array


def _rolling_mean(steps: np.ndarray, values: np.ndarray) -> Series | None:
    """Trailing mean over the finite points (window about a tenth of them); None when too few to smooth."""
    finite = np.isfinite(values)
    steps, values = steps[finite], values[finite]
    window = min(25, len(values) // 10)
    if window < 2:
        return None
    sums = np.cumsum(np.insert(values, 0, 0.0))
    means = (sums[window:] - sums[:-window]) / window
    return steps[window - 1:], means


def _draw(ax: Any, key: str, series: Series, smooth: bool) -> None:
    steps, values = series
    rolling = _rolling_mean(steps, values) if smooth else None
    marker = "o" if len(steps) <= 30 else None
    line, = ax.plot(steps, values, marker=marker, markersize=3, alpha=0.35 if rolling is not None else 1.0, label=key)
    if rolling is not None:
        ax.plot(*rolling, color=line.get_color(), linewidth=2, label=f"{key} (rolling mean)")


def _save(path: Path, title: str, panels: list[list[tuple[str, Series]]], smooth: bool) -> Path:
    """One figure with a row per panel; each panel overlays its series."""
    fig = Figure(figsize=(8, 3.2 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        for key, series in panel:
            _draw(ax, key, series, smooth)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1].set_xlabel("step")
    fig.suptitle(title)
    fig.savefig(path, dpi=100, format="png")
    return path


def _ordered_keys(records: list[dict[str, Any]]) -> list[str]:
    """Every metric name in order of first appearance."""
    return list(dict.fromkeys(key for record in records for key in record if key != "step"))


def _is_loss(key: str) -> bool:
    return key.startswith(("actor/", "critic/", "sft/")) and key.rsplit("/", 1)[-1].endswith("loss") \
        and key not in KL_KEYS


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None,
             keys: Sequence[str] | None = None, step: int | None = None) -> list[Path]:
    """Write PNG charts of ``run_dir/metrics.jsonl`` into ``out_dir`` (default ``run_dir/plots``).

    Without ``keys`` the default figures of the module doc are drawn (those with
    no data are skipped). With ``keys`` there is one figure per key instead,
    named after it (``actor/pg_loss`` -> ``actor_pg_loss.png``); a key with no
    numeric value in the run is a ValueError listing the ones there are.
    ``step`` picks the step ``timeline.png`` draws (default: the last with
    phase timings); one not in the run, or without phase timings, is a
    ValueError naming the steps there are, raised before anything is written.
    It belongs to the default figures, so it cannot go with ``keys``.
    Returns the paths written, in drawing order.
    """
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"cannot plot {run_dir}: no metrics file at {path}")
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"cannot plot {run_dir}: {path} holds no steps")
    if step is not None and keys is not None:
        raise ValueError("step chooses the step of timeline.png, a default figure: it cannot go with keys")
    timeline_record = choose_record(records, step) if keys is None else None
    out = Path(out_dir) if out_dir is not None else run_dir / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    all_keys = _ordered_keys(records)
    found = {key: s for key in all_keys if (s := _series(records, key)) is not None}

    if keys is not None:
        if isinstance(keys, str):
            keys = [keys]
        missing = [key for key in keys if key not in found]
        if missing:
            raise ValueError(f"no numeric values for {missing} in {path}; metrics with values: {sorted(found)}")
        return [_save(out / (key.replace("/", "_") + ".png"), key, [[(key, found[key])]], smooth=True)
                for key in dict.fromkeys(keys)]

    def present(names: Sequence[str]) -> list[tuple[str, Series]]:
        return [(name, found[name]) for name in names if name in found]

    written = []
    reward = present(REWARD_KEYS)
    if reward:
        written.append(_save(out / "reward.png", "reward", [reward], smooth=True))
    losses = present([key for key in all_keys if _is_loss(key)])
    if losses:
        written.append(_save(out / "losses.png", "losses", [[item] for item in losses], smooth=True))
    kl = present(KL_KEYS)
    if kl:
        written.append(_save(out / "kl.png", "KL", [[item] for item in kl], smooth=True))
    timing = present([key for key in all_keys if key.startswith("timing_s/") and not is_timeline_key(key)])
    if timing:
        written.append(_save(out / "timing.png", "time per step (s)", [timing], smooth=False))
    timeline = parse_timeline(timeline_record) if timeline_record is not None else None
    if timeline is not None:
        written.append(plot_timeline(timeline, out / "timeline.png"))
    lengths = present(RESPONSE_LENGTH_KEYS)
    if lengths:
        written.append(_save(out / "response_length.png", "response length (tokens)", [lengths], smooth=False))
    return written
