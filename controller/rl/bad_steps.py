"""Steps whose optimizer step was skipped (a NaN or Inf loss or gradient), counted in a row.

    bad = BadSteps(limit=trainer.max_bad_steps)
    in_row = bad.count(step, skipped=["actor"])   # said in the console; NonFiniteTrainingError at the limit

A skipped step leaves the weights and the optimizer's state as they were (``MegatronEngine.optimizer_step``);
a step that trains resets the count. The RL and the SFT trainer share it.
"""

from __future__ import annotations

from controller.errors import NonFiniteTrainingError

__all__ = ["BadSteps"]


class BadSteps:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.steps: list[int] = []  # the steps in a row that skipped an optimizer step

    def count(self, step: int, skipped: list[str]) -> float | None:
        """Note ``step`` (numbered as the console numbers it) and the roles that skipped their optimizer step
        in it; returns how many steps in a row skipped (None: this one trained). Raises
        ``NonFiniteTrainingError``, naming the first, when ``limit`` did."""
        if not skipped:
            self.steps = []
            return None
        self.steps.append(step)
        print(f"[hybridflow] step {step}: the {' and the '.join(skipped)} skipped "
              f"{'their' if len(skipped) > 1 else 'its'} optimizer step (a non-finite loss or gradient, located "
              f"above); {len(self.steps)} such step(s) in a row (trainer.max_bad_steps={self.limit})", flush=True)
        if len(self.steps) >= self.limit:
            raise NonFiniteTrainingError(
                f"{len(self.steps)} steps in a row skipped their optimizer steps on a non-finite loss or "
                f"gradient, the first at step {self.steps[0]} (steps {self.steps}; trainer.max_bad_steps="
                f"{self.limit}); no skipped step changed a weight")
        return float(len(self.steps))
