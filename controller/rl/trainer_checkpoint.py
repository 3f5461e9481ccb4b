"""A run's checkpoints: the trained roles' state, then the trainer's own, written last as the commit point.

    runs/x/checkpoints/actor/step_00000004/...      megatron distributed checkpoints (workers)
    runs/x/checkpoints/critic/step_00000004/...
    runs/x/checkpoints/trainer/step_00000004.json   step, data loader position, the algorithm's state
    runs/x/checkpoints/trainer/step_00000004.schedule.pt    one-step-off: the batch generated ahead;
                                                            async: the sample stream
    runs/x/checkpoints/trainer/latest               the name of the newest complete one

A step's checkpoint exists once ``trainer/latest`` names it; each file is written to a temporary
name and renamed into place, so a crash mid-save leaves the previous checkpoint as the newest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from controller.errors import ConfigError

if TYPE_CHECKING:
    from controller.rl.trainer import RLTrainer

__all__ = ["TrainerCheckpoint", "commit_trainer_state", "latest_trainer_state"]

TRAINED_ROLES = ("actor", "critic")


class TrainerCheckpoint:
    def __init__(self, run_dir: str | Path | None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None

    @property
    def root(self) -> Path:
        if self.run_dir is None:
            raise ConfigError("checkpoints need a run_dir")
        return self.run_dir / "checkpoints"

    def save(self, trainer: RLTrainer) -> Path:
        """The trained roles at ``trainer.global_step``, then the trainer's state; returns the latter's path."""
        step = trainer.global_step
        for role in TRAINED_ROLES:
            if role in trainer.groups:
                trainer.groups[role].save_checkpoint(str(self.root / role), step)
        trainer_dir = self.root / "trainer"
        trainer_dir.mkdir(parents=True, exist_ok=True)
        # One-step-off's batch generated ahead, async's stream (before the commit point: part of this step).
        schedule = trainer.schedule.state_dict(trainer_dir / f"step_{step:08d}.schedule.pt")
        state = {"step": step, "loader": trainer.loader.state_dict(), "schedule": schedule,
                 **trainer.algorithm.state_dict()}
        return commit_trainer_state(self.root, state)

    def resume(self, trainer: RLTrainer) -> int:
        """Restore the newest complete checkpoint into ``trainer`` (built); returns its step (0: none)."""
        state = latest_trainer_state(self.root)
        if state is None:
            return 0
        step = int(state["step"])
        for role in TRAINED_ROLES:
            if role in trainer.groups:
                trainer.groups[role].load_checkpoint(str(self.root / role / f"step_{step:08d}"))
        trainer.loader.load_state_dict(state["loader"])
        trainer.schedule.load_state_dict(state.get("schedule", {}), self.root / "trainer")
        trainer.algorithm.load_state_dict(state)
        trainer.global_step = step
        return step


def commit_trainer_state(root: Path, state: dict) -> Path:
    """``root/trainer/step_N.json`` (N: ``state["step"]``), then ``root/trainer/latest`` naming it: the
    commit point of a checkpoint whose other parts are already written. Returns the state's path."""
    trainer_dir = root / "trainer"
    trainer_dir.mkdir(parents=True, exist_ok=True)
    name = f"step_{int(state['step']):08d}.json"
    _atomic_write(trainer_dir / name, json.dumps(state))
    _atomic_write(trainer_dir / "latest", name)
    return trainer_dir / name


def latest_trainer_state(root: Path) -> dict | None:
    """The trainer state ``root/trainer/latest`` names: the newest complete checkpoint's; None if none."""
    pointer = root / "trainer" / "latest"
    if not pointer.is_file():
        return None
    return json.loads((pointer.parent / pointer.read_text().strip()).read_text())


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
