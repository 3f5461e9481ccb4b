"""The KL penalty in the reward and the controllers that choose its coefficient beta.

``apply_kl_penalty`` turns the reward model's token-level scores into rewards
r_t = score_t - beta * KL_t. A controller holds beta (``.value``) and updates it
once per training step with ``.update(current_kl, n_steps)``: fixed, adaptive
(Ziegler et al. 2019) or following a schedule of the step. Controllers have
``state_dict()`` / ``load_state_dict()`` for checkpoint and resume.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.policy_losses import KL_ALIASES, kl_penalty, masked_mean, zero_padding

__all__ = [
    "KL_CONTROLLER_KINDS",
    "KL_KIND_ALIASES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "Schedule",
    "ScheduledKLController",
    "apply_kl_penalty",
    "cosine_schedule",
    "exponential_decay",
    "linear_schedule",
    "make_kl_controller",
]

#: Other names for the estimators of workers.policy_losses.kl_penalty.
KL_KIND_ALIASES = KL_ALIASES

Schedule = Callable[[int], float]


def _check_number(owner: str, name: str, value: Any, *, minimum: float | None = None, strict: bool = False) -> float:
    """``value`` as a float; ValueError naming ``owner.name`` when not finite or below ``minimum``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if strict else value >= minimum
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum}"
        raise ValueError(f"{owner}: {name} must be a finite number{bound}, got {value!r}")
    return float(value)


def _check_step(owner: str, step: Any) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{owner}: step must be an int >= 0, got {step!r}")
    return step


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
    kind: str | Callable = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards with the KL to the reference policy subtracted per token.

        KL_t = kl_penalty(log_probs, ref_log_probs, kind) * mask_t   (workers.policy_losses.KL_ESTIMATOR_NAMES)
        r_t  = (score_t - beta * KL_t) * mask_t
    Metrics: ``actor/reward_kl_penalty`` is each sequence's token-mean KL averaged
    over the batch (the value to feed an adaptive controller);
    ``actor/reward_kl_penalty_coeff`` is beta.
    """
    beta = _check_number("apply_kl_penalty", "beta", beta, minimum=0.0)
    shape = token_level_scores.shape
    for name, tensor in (("log_probs", log_probs), ("ref_log_probs", ref_log_probs), ("response_mask", response_mask)):
        if tensor.shape != shape:
            raise ValueError(f"apply_kl_penalty: {name} shape {tuple(tensor.shape)} must equal token_level_scores shape {tuple(shape)}")
    mask = response_mask.to(token_level_scores.dtype)
    log_probs, ref_log_probs = zero_padding(log_probs, mask), zero_padding(ref_log_probs, mask)
    kl = kl_penalty(log_probs, ref_log_probs, kind).to(token_level_scores.dtype) * mask
    rewards = (zero_padding(token_level_scores, mask) - beta * kl) * mask
    per_sequence = masked_mean(kl, mask, dim=-1)
    metrics = {
        "actor/reward_kl_penalty": float(per_sequence.mean()),
        "actor/reward_kl_penalty_coeff": beta,
    }
    return rewards, metrics


class KLController:
    """Holds beta as ``.value``; ``update(current_kl, n_steps)`` is called once per training step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "value" not in state:
            raise ValueError(f"{type(self).__name__}.load_state_dict: missing key 'value'; got keys {sorted(state)}")
        self.value = _check_number(type(self).__name__, "value", state["value"], minimum=0.0)


class FixedKLController(KLController):
    """beta stays at ``value``."""

    def __init__(self, value: float) -> None:
        self.value = _check_number("FixedKLController", "value", value, minimum=0.0)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController(KLController):
    """Proportional control of beta toward a target KL (Ziegler et al. 2019, section 2.2).

        e    = clip(current_kl / target_kl - 1, -0.2, 0.2)
        beta = beta * (1 + e * n_steps / horizon)
    n_steps is in the units of horizon (commonly the number of samples in the step).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        self.value = _check_number("AdaptiveKLController", "init_kl_coef", init_kl_coef, minimum=0.0)
        self.target_kl = _check_number("AdaptiveKLController", "target_kl", target_kl, minimum=0.0, strict=True)
        self.horizon = _check_number("AdaptiveKLController", "horizon", horizon, minimum=0.0, strict=True)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = _check_number("AdaptiveKLController.update", "current_kl", float(current_kl))
        n_steps = _check_number("AdaptiveKLController.update", "n_steps", n_steps, minimum=0.0)
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class ScheduledKLController(KLController):
    """beta = schedule(step); ``update(current_kl, n_steps)`` advances step by n_steps.

    The step counts in whatever units the trainer passes as n_steps (1 per
    training step makes the schedule's total_steps a number of training steps).
    """

    def __init__(self, schedule: Schedule, step: int = 0) -> None:
        if not callable(schedule):
            raise TypeError(f"ScheduledKLController: schedule must be a callable step -> beta, got {schedule!r}")
        self.schedule = schedule
        self.step = _check_step("ScheduledKLController", step)

    @property
    def value(self) -> float:  # type: ignore[override]
        return float(self.schedule(self.step))

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 0:
            raise ValueError(f"ScheduledKLController.update: n_steps must be an int >= 0, got {n_steps!r}")
        self.step += n_steps

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "step" not in state:
            raise ValueError(f"ScheduledKLController.load_state_dict: missing key 'step'; got keys {sorted(state)}")
        self.step = _check_step("ScheduledKLController", state["step"])


@dataclass(frozen=True)
class _Linear:
    start: float
    end: float
    total_steps: int

    def __call__(self, step: int) -> float:
        frac = min(_check_step("linear_schedule", step), self.total_steps) / self.total_steps
        return self.start + (self.end - self.start) * frac


@dataclass(frozen=True)
class _ExponentialDecay:
    start: float
    decay_rate: float
    decay_steps: float
    minimum: float

    def __call__(self, step: int) -> float:
        value = self.start * self.decay_rate ** (_check_step("exponential_decay", step) / self.decay_steps)
        return max(value, self.minimum)


@dataclass(frozen=True)
class _Cosine:
    start: float
    end: float
    total_steps: int

    def __call__(self, step: int) -> float:
        frac = min(_check_step("cosine_schedule", step), self.total_steps) / self.total_steps
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _check_total_steps(owner: str, total_steps: Any) -> int:
    if not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps <= 0:
        raise ValueError(f"{owner}: total_steps must be an int > 0, got {total_steps!r}")
    return total_steps


def linear_schedule(start: float, end: float, total_steps: int) -> Schedule:
    """beta(step) = start + (end - start) * min(step, total_steps) / total_steps."""
    return _Linear(
        _check_number("linear_schedule", "start", start, minimum=0.0),
        _check_number("linear_schedule", "end", end, minimum=0.0),
        _check_total_steps("linear_schedule", total_steps),
    )


def exponential_decay(start: float, decay_rate: float, decay_steps: float, minimum: float = 0.0) -> Schedule:
    """beta(step) = max(start * decay_rate ** (step / decay_steps), minimum), with 0 < decay_rate <= 1."""
    start = _check_number("exponential_decay", "start", start, minimum=0.0)
    rate = _check_number("exponential_decay", "decay_rate", decay_rate, minimum=0.0, strict=True)
    if rate > 1.0:
        raise ValueError(f"exponential_decay: decay_rate must be in (0, 1], got {decay_rate!r}")
    steps = _check_number("exponential_decay", "decay_steps", decay_steps, minimum=0.0, strict=True)
    floor = _check_number("exponential_decay", "minimum", minimum, minimum=0.0)
    if floor > start:
        raise ValueError(f"exponential_decay: minimum must be <= start ({start!r}), got {minimum!r}")
    return _ExponentialDecay(start, rate, steps, floor)


def cosine_schedule(start: float, end: float, total_steps: int) -> Schedule:
    """Half cosine from start to end: beta(step) = end + (start - end) * (1 + cos(pi * min(step, N) / N)) / 2."""
    return _Cosine(
        _check_number("cosine_schedule", "start", start, minimum=0.0),
        _check_number("cosine_schedule", "end", end, minimum=0.0),
        _check_total_steps("cosine_schedule", total_steps),
    )


_SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "linear": linear_schedule,
    "exponential": exponential_decay,
    "cosine": cosine_schedule,
}

#: kind -> what ``make_kl_controller`` builds and which keyword arguments it takes.
KL_CONTROLLER_KINDS: dict[str, Callable[..., Any]] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
    **_SCHEDULES,
}


def make_kl_controller(kind: str, **kwargs: Any) -> KLController:
    """Build a controller by kind; the keyword arguments go to its constructor or schedule.

    fixed(value), adaptive(init_kl_coef, target_kl, horizon), and the scheduled
    kinds linear(start, end, total_steps), exponential(start, decay_rate,
    decay_steps, minimum=0.0), cosine(start, end, total_steps).
    """
    try:
        factory = KL_CONTROLLER_KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KL controller kind {kind!r}; valid: {sorted(KL_CONTROLLER_KINDS)}") from None
    params = inspect.signature(factory).parameters
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty]
    unexpected = sorted(set(kwargs) - set(params))
    missing = [n for n in required if n not in kwargs]
    if unexpected or missing:
        raise ValueError(
            f"KL controller kind {kind!r} takes {list(params)}; "
            f"unexpected: {unexpected}, missing: {missing}"
        )
    built = factory(**kwargs)
    return ScheduledKLController(built) if kind in _SCHEDULES else built
