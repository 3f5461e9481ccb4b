"""Coefficient schedules as values at a step, for a researcher's own loss terms.

    from hybridflow.utils import linear_schedule
    beta = linear_schedule(0.2, 0.02, step, total_steps)     # 0.2 at step 0, 0.02 from total_steps on

They are the schedules the KL controller runs (``algorithm.kl_ctrl: {kind: scheduled, ...}``,
``controller.algorithms.kl_control``), evaluated at one step; the controller's own functions of the
same names return the schedule instead. Bad arguments raise ValueError naming the argument.
"""

from __future__ import annotations

from controller.algorithms import kl_control

__all__ = ["cosine_schedule", "exponential_decay", "linear_schedule"]


def linear_schedule(start: float, end: float, step: int, total_steps: int) -> float:
    """start + (end - start) * min(step, total_steps) / total_steps."""
    return kl_control.linear_schedule(start, end, total_steps)(step)


def exponential_decay(start: float, decay_rate: float, step: int, decay_steps: float, minimum: float = 0.0) -> float:
    """max(start * decay_rate ** (step / decay_steps), minimum), with 0 < decay_rate <= 1."""
    return kl_control.exponential_decay(start, decay_rate, decay_steps, minimum)(step)


def cosine_schedule(start: float, end: float, step: int, total_steps: int) -> float:
    """From start to end along half a cosine over total_steps, then end."""
    return kl_control.cosine_schedule(start, end, total_steps)(step)
