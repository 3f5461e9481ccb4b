"""A run's checkpoints: the trained roles' state, then the trainer's own, written last as the commit point.

    runs/x/checkpoints/actor/step_00000004/...      megatron distributed checkpoints (workers)
    runs/x/checkpoints/critic/step_00000004/...
    runs/x/checkpoints/trainer/step_00000004.json   step, data loader position, the algorithm's state
    runs/x/checkpoints/trainer/step_00000004.schedule.pt    one-step-off: the batch generated ahead;
                                                            async: the sample stream
    runs/x/checkpoints/trainer/latest               the name of the newest complete one

A step's checkpoint exists once ``trainer/latest`` names it; each file is written to a temporary
name and renamed into place, so a crash mid-save leaves the previous checkpoint as the newest.

The commit record (``trainer/step_N.json``) carries the size and sha256 of every file of the checkpoint
(``checkpoint_integrity``). A resume verifies them first: a checkpoint with a file missing, torn or changed
is reported by file and passed over for the newest older one that verifies. A save that fails (a full disk,
a quota) stops the run (``CheckpointWriteError``) with the newest complete checkpoint untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.errors import CallTimeoutError, ConfigError, TrainingStoppedError, WorkerDiedError
from controller.rl.checkpoint_integrity import checksums, verify
from controller.runtime.hang_watch import HangError

__all__ = ["CheckpointWriteError", "TrainerCheckpoint", "TrainingState", "commit_trainer_state", "latest_trainer_state", "saving"]

TRAINED_ROLES = ("actor", "critic")
FULL_DISK_BYTES = 1 << 20  # free space below this after a failed save: the filesystem is full


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint holds of a run, and restores into: the step, the trained roles' groups, the prompt
    loader's position, the schedule's samples ahead, the algorithm's state and the bad steps in a row."""

    step: int
    groups: Mapping[str, Any]
    loader: Any
    schedule: Any
    algorithm: Any
    bad_steps: Any


class TrainerCheckpoint:
    def __init__(self, run_dir: str | Path | None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None

    @property
    def root(self) -> Path:
        if self.run_dir is None:
            raise ConfigError("checkpoints need a run_dir")
        return self.run_dir / "checkpoints"

    def save(self, state: TrainingState) -> Path:
        """The trained roles at ``state.step``, then the trainer's state; returns the latter's path."""
        step = state.step
        roles = [role for role in TRAINED_ROLES if role in state.groups]
        trainer_dir = self.root / "trainer"
        schedule_path = trainer_dir / f"step_{step:08d}.schedule.pt"
        with saving(self.root, step):
            for role in roles:
                state.groups[role].save_checkpoint(str(self.root / role), step)
            trainer_dir.mkdir(parents=True, exist_ok=True)
            # One-step-off's batch generated ahead, async's stream (before the commit point: part of this step).
            schedule = state.schedule.state_dict(schedule_path)
            record = {"step": step, "loader": state.loader.state_dict(), "schedule": schedule,
                      "bad_steps": state.bad_steps.steps, **state.algorithm.state_dict()}
            return commit_trainer_state(self.root, record, [self.root / role / f"step_{step:08d}" for role in roles]
                                        + [schedule_path])

    def resume(self, state: TrainingState) -> int:
        """Restore the newest complete checkpoint that verifies into ``state`` (a built job's); returns its step
        (0: none)."""
        record = latest_trainer_state(self.root)
        if record is None:
            return 0
        step = int(record["step"])
        for role in TRAINED_ROLES:
            if role in state.groups:
                state.groups[role].load_checkpoint(str(self.root / role / f"step_{step:08d}"))
        state.loader.load_state_dict(record["loader"])
        state.schedule.load_state_dict(record.get("schedule", {}), self.root / "trainer")
        state.algorithm.load_state_dict(record)
        state.bad_steps.steps = list(record.get("bad_steps", []))  # a resumed run counts on in a row
        return step


class CheckpointWriteError(TrainingStoppedError):
    """A checkpoint could not be written (a full disk, a quota); the newest complete one is untouched."""


@contextmanager
def saving(root: Path, step: int):
    """Turns a failed save of ``step`` into ``CheckpointWriteError`` naming the newest complete checkpoint (which
    nothing touched); the failed save's partial directories are removed. A worker lost or hung during the save
    is not the write's fault: its error goes on as it is (a restart can get past it)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 (whatever a role's writer raised: the run stops with the reason)
        lost = isinstance(exc, (HangError, WorkerDiedError, CallTimeoutError))
        reason = None if lost else _write_failure(root, exc)  # before the partial write goes (it filled the disk)
        for partial in root.glob(f"*/.step_{step:08d}.tmp"):
            shutil.rmtree(partial, ignore_errors=True)
        if lost:
            raise
        raise CheckpointWriteError(f"the checkpoint of step {step} could not be written under {root} ({reason}); "
                                   f"{_kept(root)}. Free space, then resume (trainer.resume=true)") from exc


def _write_failure(root: Path, exc: BaseException) -> str:
    """Why a save failed, in a line: a full filesystem is said as such (writers report it in their own words)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = lines[-1] if lines else type(exc).__name__
    if free is not None and free < FULL_DISK_BYTES or "No space left" in str(exc):
        return f"the filesystem is full: {free} bytes free; the writer said: {said[:200]}"
    return said[:300]


def _kept(root: Path) -> str:
    state = latest_trainer_state(root, log=lambda line: None)  # verified: the one a resume would take
    return (f"the newest complete checkpoint, step {state['step']}, is untouched and verifies" if state is not None
            else "no earlier checkpoint exists")


def commit_trainer_state(root: Path, state: dict, parts: list[Path] = ()) -> Path:
    """``root/trainer/step_N.json`` (N: ``state["step"]``) with the checksums of ``parts`` (the checkpoint's
    files and directories, already written), then ``root/trainer/latest`` naming it: the commit point of a
    checkpoint. Returns the state's path."""
    trainer_dir = root / "trainer"
    trainer_dir.mkdir(parents=True, exist_ok=True)
    name = f"step_{int(state['step']):08d}.json"
    state = {**state, "files": checksums(root, parts)}
    _atomic_write(trainer_dir / name, json.dumps(state))
    _atomic_write(trainer_dir / "latest", name)
    return trainer_dir / name


def latest_trainer_state(root: Path, log=None) -> dict | None:
    """The state of the newest complete checkpoint whose files verify (``checkpoint_integrity``), from the one
    ``root/trainer/latest`` names down; None if none. A checkpoint that fails is reported through ``log`` (to
    stderr by default), by file, and passed over."""
    pointer = root / "trainer" / "latest"
    if not pointer.is_file():
        return None
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    newest = _step_of(pointer.read_text().strip())
    for step in sorted((s for s in _committed_steps(root) if s <= newest), reverse=True):
        path = root / "trainer" / f"step_{step:08d}.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log(f"[hybridflow] checkpoint step {step} is damaged: {path.name}: unreadable ({exc}); "
                f"using the previous one")
            continue
        problems = verify(root, state.get("files", {}))  # a record from before checksums: nothing to verify
        if not problems:
            return state
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        log(f"[hybridflow] checkpoint step {step} is damaged: {shown}; using the previous one")
    return None


def _step_of(name: str) -> int:
    return int(name.removeprefix("step_").split(".")[0])


def _committed_steps(root: Path) -> list[int]:
    return [_step_of(p.name) for p in (root / "trainer").glob("step_*.json")]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
