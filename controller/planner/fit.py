"""The planner's host costs fitted to measured phase times.

A phase's predicted time is linear in the host costs (``timing.HOST_COSTS``)
and in the collectives' latency: ``t = base + sum_k cost_k * count_k``. A
``Sample`` holds one measured phase with its ``base`` (the model's time with
every cost at zero) and its ``counts`` (how much the time grows per second
of each cost), both taken from the model itself, so the fit and the
planner cannot disagree on what a cost means.

``fit_costs`` finds the costs that minimise the squared relative error over
the samples, none negative. It is exact non-negative least squares: with a
handful of costs it solves the unconstrained problem on every subset of
them and keeps the best solution that is non-negative (the optimum is the
least-squares solution on its own support, so it is among them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Sample", "fit_costs", "predict"]


@dataclass(frozen=True)
class Sample:
    name: str  # e.g. "tiny-dp4/actor/update"
    measured: float  # seconds
    base: float  # predicted seconds with every cost at zero
    counts: dict[str, float] = field(default_factory=dict)  # d(predicted) / d(cost)


def predict(sample: Sample, costs: dict[str, float]) -> float:
    return sample.base + sum(costs.get(name, 0.0) * count for name, count in sample.counts.items())


def fit_costs(samples: list[Sample], names: tuple[str, ...]) -> dict[str, float]:
    """The non-negative costs (seconds) that best predict ``samples``, by squared relative error."""
    if not samples:
        raise ValueError("fit_costs needs at least one measured sample")
    bad = [s.name for s in samples if not s.measured > 0]
    if bad:
        raise ValueError(f"measured times must be > 0 s; not so for {bad}")
    weights = np.array([1.0 / s.measured for s in samples])
    counts = np.array([[s.counts.get(n, 0.0) for n in names] for s in samples]) * weights[:, None]
    target = np.array([s.measured - s.base for s in samples]) * weights
    best, best_error = np.zeros(len(names)), float(target @ target)
    for size in range(1, len(names) + 1):
        for support in itertools.combinations(range(len(names)), size):
            columns = counts[:, support]
            if not np.any(columns):
                continue
            solution, *_ = np.linalg.lstsq(columns, target, rcond=None)
            if np.any(solution < 0):
                continue
            residual = target - columns @ solution
            error = float(residual @ residual)
            if error < best_error - 1e-15:
                best = np.zeros(len(names))
                best[list(support)] = solution
                best_error = error
    return {name: float(value) for name, value in zip(names, best)}
