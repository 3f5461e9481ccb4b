"""Rollout schedules: when a step's batch is generated, and with which weights (``trainer.mode``).

* ``sync``: each step generates its batch on the actor's current weights, then trains on it.
* ``one_step_off``: with the rollout on a pool of its own, the batch of step k+1 is generated while
  step k trains, on the weights from before step k's update; every trained sample is one update stale.
  The generation pool and the training pool are busy at the same time.

Every sample carries the policy version that generated it (``policy_version``: the number of actor
updates behind its weights). At training time a sample is ``version_now - policy_version`` updates
stale; samples staler than ``trainer.max_staleness`` are not trained on and are counted
(``staleness/dropped``). Off the on-policy path the rollout correction's ``auto`` mode turns on
(truncated importance weights between the rollout's log-probs and the trainer's).

A checkpoint of a one-step-off run holds the batch generated in advance, so a resumed run trains
on exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workers.data_proto import DataProto

if TYPE_CHECKING:
    from controller.algorithms import StepState
    from controller.trainer import RLTrainer

__all__ = ["TRAINER_MODES", "OneStepOff", "SyncSchedule", "build_schedule", "drop_stale", "generation_seed",
           "staleness_metrics", "with_sampling"]

TRAINER_MODES = ("sync", "one_step_off")
VERSION_KEY = "policy_version"


def generation_seed(trainer_seed: int, step: int, round_index: int = 0) -> int:
    """The sampling seed of step ``step``'s generation round ``round_index``: a function of the schedule only."""
    return trainer_seed * 1_000_003 + step * 100_000 + round_index * 10_007


def staleness_metrics(versions: torch.Tensor, now: int, max_staleness: int) -> dict[str, float]:
    """Mean and max staleness of a batch's samples, a histogram (``staleness/hist/<k>``), and how many
    exceed ``max_staleness``."""
    stale = now - versions.long()
    if (stale < 0).any():
        raise ValueError(f"a sample's policy version {int(versions.max())} is ahead of the trainer's {now}")
    metrics = {"staleness/mean": float(stale.float().mean()), "staleness/max": float(stale.max()),
               "staleness/dropped": float((stale > max_staleness).sum())}
    for k in range(int(stale.max()) + 1):
        metrics[f"staleness/hist/{k}"] = float((stale == k).sum())
    return metrics


def drop_stale(batch: DataProto, now: int, max_staleness: int) -> tuple[DataProto, dict[str, float]]:
    """``batch`` without the samples more than ``max_staleness`` updates behind ``now``; the staleness metrics.

    A prompt's samples are kept or dropped together (group advantages compare them), by the oldest.
    """
    versions = batch.batch[VERSION_KEY]
    metrics = staleness_metrics(versions, now, max_staleness)
    keep = (now - versions.long()) <= max_staleness
    if "uid" in batch.non_tensor_batch:
        uids = list(batch.non_tensor_batch["uid"])
        bad = {uid for uid, ok in zip(uids, keep.tolist()) if not ok}
        keep = torch.tensor([uid not in bad for uid in uids])
    if bool(keep.all()):
        return batch, metrics
    if not bool(keep.any()):
        raise RuntimeError(f"every sample of the step is more than trainer.max_staleness={max_staleness} updates "
                           f"stale (the trainer is at version {now}); raise max_staleness")
    return batch[keep], metrics


class SyncSchedule:
    """Generate the step's batch now, on the actor's current weights."""

    def rollout(self, trainer: RLTrainer, state: StepState) -> DataProto:
        state.prompts = trainer.algorithm.before_generation(trainer, state, trainer.loader.next_batch())
        return trainer.generate_and_score(state.prompts, state)

    def state_dict(self, path: Path) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], path: Path) -> None:
        pass


class OneStepOff:
    """Step k trains on the batch generated during step k-1 (on the weights before step k-1's update),
    while the rollout pool generates step k+1's."""

    def __init__(self, max_staleness: int = 1) -> None:
        self.max_staleness = max_staleness
        self.in_flight = None  # (prompts, the generation's future, its policy version)
        # A batch generated ahead and already collected (at a checkpoint, or loaded from one)
        self.ready: tuple[DataProto, DataProto, int] | None = None

    def _launch(self, trainer: RLTrainer, state: StepState, step: int) -> None:
        prompts = trainer.algorithm.before_generation(trainer, state, trainer.loader.next_batch())
        # The weights the actor has now; the transfer counts towards the step it happens in.
        trainer.record_rollout_metrics(state, trainer.rollout_link.sync())
        sampling = {"seed": generation_seed(trainer.seed, step)}
        future = trainer.groups["rollout"].generate_sequences.submit(with_sampling(prompts, sampling))
        self.in_flight = (prompts, future, trainer.global_step)

    def _collect(self, trainer: RLTrainer, state: StepState) -> tuple[DataProto, DataProto, int]:
        if self.ready is not None:
            (prompts, out, version), self.ready = self.ready, None
        else:
            prompts, future, version = self.in_flight
            self.in_flight = None
            with state.timed("wait_rollout"):  # what generation did not hide behind the previous step
                out = future.result()
        trainer.record_rollout_metrics(state, out.meta_info.pop("metrics", {}))
        return prompts, out, version

    def rollout(self, trainer: RLTrainer, state: StepState) -> DataProto:
        if self.in_flight is None and self.ready is None:  # the first step: nothing generated ahead yet
            self._launch(trainer, state, state.step)
        prompts, out, version = self._collect(trainer, state)
        state.prompts = prompts
        self._launch(trainer, state, state.step + 1)  # overlaps with this step's scoring and training
        out.batch[VERSION_KEY] = torch.full((len(out),), version, dtype=torch.long)
        with state.timed("reward"):
            batch = out.union(trainer.score(out))
        batch, metrics = drop_stale(batch, trainer.global_step, self.max_staleness)
        state.metrics.update(metrics)
        return batch

    # ----------------------------------------------------------- checkpoint
    def state_dict(self, path: Path) -> dict[str, Any]:
        """Waits for the batch generated ahead and writes it to ``path``: a resumed run trains on it next."""
        if self.in_flight is not None:
            prompts, future, version = self.in_flight
            out = future.result()
            self.in_flight = None
            self.ready = (prompts, out, version)
        if self.ready is None:
            return {}
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(self.ready, tmp)
        tmp.replace(path)
        return {"generated_ahead": path.name}

    def load_state_dict(self, state: dict[str, Any], path: Path) -> None:
        self.in_flight = None
        self.ready = torch.load(path, weights_only=False) if state.get("generated_ahead") else None


def build_schedule(mode: str, max_staleness: int):
    if mode == "sync":
        return SyncSchedule()
    if mode == "one_step_off":
        return OneStepOff(max_staleness)
    raise ValueError(f"trainer.mode {mode!r} is not one of {TRAINER_MODES}")


def with_sampling(prompts: DataProto, sampling: dict[str, Any]) -> DataProto:
    """``prompts`` with ``sampling`` (SamplingConfig fields over the rollout's) for the rollout to apply."""
    return DataProto(prompts.batch, prompts.non_tensor_batch, {**prompts.meta_info, "sampling": sampling})
