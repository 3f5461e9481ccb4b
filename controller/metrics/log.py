"""Per-step run metrics: a console line and progress bar, a JSONL file, TensorBoard, wandb.

The training loop calls ``MetricsLogger.log(step, metrics)`` once per step with
a flat dict of names such as ``actor/pg_loss`` or ``timing_s/gen``. Each backend
chosen at construction gets the step:

``console``
    a tqdm progress bar on stderr (hidden when stderr is not a terminal) and,
    above it, one summary line per step built by :func:`format_step_line`.
``jsonl``
    ``run_dir/metrics.jsonl``, one ``{"step": k, **metrics}`` object per line,
    flushed line by line so a crash loses at most the step being written.
``tensorboard``
    ``run_dir/tensorboard`` event files, one scalar per numeric metric.
``wandb``
    ``wandb.log`` of the numeric metrics; needs the ``wandb`` package.

Values that are not plain numbers:

* NaN and +-inf cannot be written as standard JSON, so the JSONL file stores
  them as ``null``; TensorBoard and wandb receive the float itself (both show
  NaN) and the console prints ``nan``/``inf``.
* Zero-dimensional numpy values and tensors count as numbers (``.item()``).
* Booleans, strings, lists and dicts go to JSONL only (non-finite floats
  inside them also become ``null``); anything JSON cannot encode is dropped.

Resuming: a fresh logger (``resume=False``) starts ``metrics.jsonl`` empty. With
``resume=True`` the file is kept and the caller, who knows the step it restarts
from, calls :meth:`MetricsLogger.truncate_after` so steps that will be redone
are not written twice; TensorBoard hides its copies of those steps as well.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "BACKENDS",
    "CONSOLE_FIELDS",
    "METRICS_FILE",
    "TENSORBOARD_DIR",
    "MetricsLogger",
    "format_step_line",
    "read_metrics",
    "validation_summary",
]

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
TIMING_PREFIX = "timing_s/"

# (label, metric keys tried in order, format) for the console line; the first
# key present in a step's metrics is shown, entries with none present are left out.
CONSOLE_FIELDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("loss", ("sft/loss",), "{:.3g}"),
    ("val_loss", ("sft/val_loss",), "{:.3g}"),
    ("reward", ("critic/score/mean", "critic/rewards/mean"), "{:.3g}"),
    ("val", ("val/reward/mean",), "{:.3g}"),
    ("reverse_kl", ("actor/opd/reverse_kl",), "{:.3g}"),  # a teacher's: KL(student || teacher)
    ("kl", ("actor/ppo_kl",), "{:.2g}"),
    ("pg_loss", ("actor/pg_loss",), "{:.3g}"),
    ("vf_loss", ("critic/vf_loss",), "{:.3g}"),
    ("entropy", ("actor/entropy",), "{:.3g}"),
    ("clipfrac", ("actor/pg_clipfrac",), "{:.3g}"),
    ("grad_norm", ("actor/grad_norm", "sft/grad_norm"), "{:.3g}"),
    ("resp_len", ("response_length/mean",), "{:.1f}"),
    ("tok/s", ("perf/throughput",), "{:.0f}"),
    ("mem", ("perf/max_memory_gb",), "{:.1f}GB"),
)


def _as_number(value: Any) -> int | float | None:
    """``value`` as a Python int or float, or None when it is not a scalar number (bools are not)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy scalar, 0-d tensor
        item = value.item()
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            return item
    return None


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats replaced by None (recursively); raises TypeError if not JSON-encodable."""
    number = _as_number(value)
    if number is not None:
        return number if math.isfinite(number) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    json.dumps(value, allow_nan=False)  # bool, str, None pass; anything else raises TypeError
    return value


def format_step_line(step: int, total: int | None, metrics: Mapping[str, Any]) -> str:
    """One human-readable summary of a step, e.g. ``step 3/20 | reward 0.412 | kl 0.0031 | gen 1.20s``.

    The known fields of :data:`CONSOLE_FIELDS` come first, in that order, then
    every ``timing_s/*`` key in the order of ``metrics`` with the prefix
    stripped and seconds to two decimals. Non-numeric values are left out.
    """
    parts = [f"step {step}/{total}" if total is not None else f"step {step}"]
    for label, keys, fmt in CONSOLE_FIELDS:
        for key in keys:
            number = _as_number(metrics.get(key))
            if number is not None:
                parts.append(f"{label} {fmt.format(number)}")
                break
    timings = []
    for key, value in metrics.items():
        number = _as_number(value)
        if key.startswith(TIMING_PREFIX) and number is not None:
            timings.append(f"{key[len(TIMING_PREFIX):]} {number:.2f}s")
    if timings:
        parts.append(" ".join(timings))
    return " | ".join(parts)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step records of ``run_dir/metrics.jsonl`` in file order.

    A trailing line that is not valid JSON (a write cut short by a crash) is
    skipped; a bad line anywhere else raises ValueError naming the line.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path} (a MetricsLogger with the 'jsonl' backend writes it)")
    lines = path.read_text(encoding="utf-8").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                break  # partial last line
            raise ValueError(f"{path} line {number} is not valid JSON: {error}") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path} line {number} is not a step record (an object with an integer 'step'): {line!r}")
        records.append(record)
    return records


def validation_summary(records: list[Mapping[str, Any]], key: str = "val/reward/mean",
                       labels: tuple[str, str] | None = None) -> str | None:
    """Where validation started and ended, e.g. ``val/reward/mean 0.391 at step 0 -> 0.625 at step 60 (+0.234)``.

    ``records`` are step records (``read_metrics``); the first and the last that hold ``key`` are
    quoted, or the one when there is only one. ``labels`` name the two points, e.g. ("after SFT",
    "after RL"): ``0.391 at step 0 (after SFT) -> 0.625 at step 60 (after RL) (+0.234)``. None when no
    record holds ``key``.
    """
    points = [(record["step"], number) for record in records if (number := _as_number(record.get(key))) is not None]
    if not points:
        return None
    first_label, last_label = (f" ({label})" for label in labels) if labels else ("", "")
    (first_step, first), (last_step, last) = points[0], points[-1]
    if len(points) == 1:
        return f"{key} {first:.3f} at step {first_step}{first_label}"
    return (f"{key} {first:.3f} at step {first_step}{first_label} -> {last:.3f} at step {last_step}{last_label} "
            f"({last - first:+.3f})")


class MetricsLogger:
    """Sends each step's metrics to the chosen backends; also a context manager that closes them.

    ``run_dir`` is created if missing. ``total_steps`` sizes the console bar and
    the ``step k/N`` label. ``project``, ``run_name`` and ``config`` go to
    ``wandb.init``. ``resume`` keeps an existing ``metrics.jsonl`` (see
    :meth:`truncate_after`) and asks wandb to resume the run of that name.
    ``fields`` are added to every record (a restarted job: ``job/restarts`` and
    ``job/data_parallel``).
    """

    def __init__(
        self,
        run_dir: str | Path,
        backends: Sequence[str] = ("console", "jsonl", "tensorboard"),
        total_steps: int | None = None,
        project: str = "hybridflow",
        run_name: str | None = None,
        config: dict | None = None,
        resume: bool = False,
        fields: Mapping[str, float] | None = None,
    ) -> None:
        if isinstance(backends, str):
            backends = (backends,)
        unknown = [name for name in backends if name not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown logger backend(s) {unknown}; valid backends are {list(BACKENDS)}")
        if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                        or total_steps < 1):
            raise ValueError(f"total_steps must be a positive int or None, got {total_steps!r}")
        self.backends: tuple[str, ...] = tuple(dict.fromkeys(backends))
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.resume = resume
        self.fields = dict(fields or {})
        self._closed = False
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._wandb_run = None

        wandb = None
        if "wandb" in self.backends:  # check before creating anything
            try:
                import wandb
            except ImportError:
                raise ImportError("wandb was asked for in logger backends but is not installed: pip install wandb") \
                    from None

        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if "jsonl" in self.backends:
                self._jsonl = open(self.metrics_path, "a" if resume else "w", encoding="utf-8")
            if "tensorboard" in self.backends and not resume:  # a resumed run opens it in truncate_after or log
                self._tb = self._open_tensorboard(purge_step=None)
            if "console" in self.backends:
                from tqdm import tqdm

                self._bar = tqdm(total=total_steps, file=sys.stderr, unit="step", dynamic_ncols=True, disable=None)
            if wandb is not None:
                self._wandb_run = wandb.init(project=project, name=run_name, config=config, dir=str(self.run_dir),
                                             resume="allow" if resume else None)
        except BaseException:
            self.close()  # release what was opened before the failure
            raise

    @property
    def metrics_path(self) -> Path:
        """Where the ``jsonl`` backend writes."""
        return self.run_dir / METRICS_FILE

    def _open_tensorboard(self, purge_step: int | None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=purge_step)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` for ``step`` on every backend (see the module doc for non-numeric values)."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r} ({type(step).__name__})")
        if "step" in metrics:
            raise ValueError("metrics must not contain the key 'step': it is written from the step argument")
        if self.fields:
            metrics = {**metrics, **self.fields}
        numeric = {}
        for key, value in metrics.items():
            number = _as_number(value)
            if number is not None:
                numeric[key] = number
        if self._jsonl is not None:
            record: dict[str, Any] = {"step": step}
            for key, value in metrics.items():
                try:
                    record[str(key)] = _json_safe(value)
                except (TypeError, ValueError):
                    pass  # not JSON-encodable: left out of the file
            self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
            self._jsonl.flush()
        if "tensorboard" in self.backends:
            if self._tb is None:
                self._tb = self._open_tensorboard(purge_step=None)
            for key, number in numeric.items():
                self._tb.add_scalar(key, number, step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(numeric, step=step)
        if self._bar is not None:
            self._bar.write(format_step_line(step, self.total_steps, metrics), file=sys.stderr)
            if step > 0:  # step 0 holds what was measured before training (validation), not a step
                self._bar.update(1)

    def truncate_after(self, step: int) -> int:
        """Forget steps ``>= step`` before a resumed run logs them again; returns how many records remain.

        ``metrics.jsonl`` keeps only the lines whose step is below ``step`` (a
        partial last line is dropped too) and is replaced atomically; the
        TensorBoard writer is reopened with ``purge_step=step`` so TensorBoard
        hides its old events from that step on; the console bar restarts at the
        number of records kept (or at ``step`` without the jsonl backend).
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r} ({type(step).__name__})")
        kept = steps_kept = step
        if self._jsonl is not None:
            self._jsonl.close()
            records = [r for r in read_metrics(self.run_dir) if r["step"] < step] \
                if self.metrics_path.is_file() else []
            fd, tmp = tempfile.mkstemp(prefix=f".{METRICS_FILE}.", suffix=".tmp", dir=self.run_dir)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    for record in records:
                        out.write(json.dumps(record, allow_nan=False) + "\n")
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, self.metrics_path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._jsonl = open(self.metrics_path, "a", encoding="utf-8")
            kept = len(records)
            steps_kept = sum(r["step"] > 0 for r in records)  # a step-0 record (before training) is not a step
        if "tensorboard" in self.backends:
            if self._tb is not None:
                self._tb.close()
            self._tb = self._open_tensorboard(purge_step=step)
        if self._bar is not None:
            self._bar.n = steps_kept
            self._bar.refresh()
        return kept

    def close(self) -> None:
        """Flush and close every backend; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
