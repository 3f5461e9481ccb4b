"""Rollout schedules: when a step's batch is generated, and with which weights (``trainer.mode``).

* ``sync``: each step generates its batch on the actor's current weights, then trains on it.
* ``one_step_off``: with the rollout on a pool of its own, the batch of step k+1 is generated while
  step k trains, on the weights from before step k's update; every trained sample is one update stale.
  The generation pool and the training pool are busy at the same time.
* ``async``: the rollout on its own pool generates a stream of samples (``controller.rl.sample_stream``),
  one rollout call always in flight; a step trains on the oldest ready prompt groups, and groups start
  only while they can be trained within ``trainer.max_staleness`` updates. A call advances every sample
  by at most ``trainer.partial_rollout_tokens`` tokens (default: a whole response). New weights reach
  the rollout at the first call boundary after each update; with chunks shorter than a response they
  interrupt the samples in the middle of their responses, which continue under them (partial rollouts;
  ``token_versions`` records each token's version), so a long response no longer holds a step back.

Every sample carries the policy version that generated it (``policy_version``: the number of actor
updates behind its weights). At training time a sample is ``version_now - policy_version`` updates
stale; samples staler than ``trainer.max_staleness`` are not trained on and are counted
(``staleness/dropped``). Off the on-policy path the rollout correction's ``auto`` mode turns on
(truncated importance weights between the rollout's log-probs and the trainer's).

A schedule sees the trainer through a ``RolloutSource`` (``controller.rl.rollout_source``): prompts,
generation calls, the weights' transfer and scoring, never the trainer itself.

A checkpoint of a one-step-off run holds the batch generated in advance, and one of an async run the
whole stream (prompts drawn, samples in generation with their tokens so far, ready groups), so a
resumed run trains on exactly the batches an uninterrupted one would have, losing and repeating none.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from controller.rl.rollout_source import RolloutSource
from controller.rl.sample_stream import SampleStream, mixed_version_samples
from workers.data_proto import DataProto

if TYPE_CHECKING:
    from controller.algorithms import StepState

__all__ = ["TRAINER_MODES", "AsyncStream", "OneStepOff", "SyncSchedule", "atomic_save", "build_schedule", "drop_stale",
           "generation_seed", "scored_stream_batch", "staleness_metrics", "with_sampling"]

TRAINER_MODES = ("sync", "one_step_off", "async")
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


def scored_stream_batch(source: RolloutSource, state: StepState, batch: DataProto, version: int, max_staleness: int,
                        dropped_samples: int, stream_metrics: dict[str, float]) -> DataProto:
    """A batch taken from a stream (``policy_version``, ``token_versions``) scored, with the step's staleness
    and stream metrics: ``dropped_samples`` since the last step, and the stream's own ``stream_metrics``."""
    with state.timed("reward"):
        batch = batch.union(source.score(batch))
    state.metrics.update(staleness_metrics(batch.batch[VERSION_KEY], version, max_staleness))
    state.metrics["staleness/dropped"] = float(dropped_samples)
    state.metrics["stream/mixed_version_samples"] = float(mixed_version_samples(batch.batch["token_versions"]))
    state.metrics.update(stream_metrics)
    return batch


class SyncSchedule:
    """Generate the step's batch now, on the actor's current weights."""

    def rollout(self, source: RolloutSource, state: StepState) -> DataProto:
        state.prompts = source.next_prompts(state)
        return source.generate_and_score(state.prompts, state)

    def state_dict(self, path: Path) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        pass


class OneStepOff:
    """Step k trains on the batch generated during step k-1 (on the weights before step k-1's update),
    while the rollout pool generates step k+1's."""

    def __init__(self, max_staleness: int = 1) -> None:
        self.max_staleness = max_staleness
        self.in_flight = None  # (prompts, the generation's future, its policy version)
        # A batch generated ahead and already collected (at a checkpoint, or loaded from one)
        self.ready: tuple[DataProto, DataProto, int] | None = None

    def _launch(self, source: RolloutSource, state: StepState, step: int) -> None:
        prompts = source.next_prompts(state)
        # The weights the actor has now; the transfer counts towards the step it happens in.
        source.record_rollout_metrics(state, source.sync_weights())
        sampling = {"seed": generation_seed(source.seed, step)}
        future = source.submit("generate_sequences", with_sampling(prompts, sampling))
        self.in_flight = (prompts, future, source.version)

    def _collect(self, source: RolloutSource, state: StepState) -> tuple[DataProto, DataProto, int]:
        if self.ready is not None:
            (prompts, out, version), self.ready = self.ready, None
        else:
            prompts, future, version = self.in_flight
            self.in_flight = None
            with state.timed("wait_rollout"):  # what generation did not hide behind the previous step
                out = future.result()
        source.record_rollout_metrics(state, out.meta_info.pop("metrics", {}))
        return prompts, out, version

    def rollout(self, source: RolloutSource, state: StepState) -> DataProto:
        if self.in_flight is None and self.ready is None:  # the first step: nothing generated ahead yet
            self._launch(source, state, state.step)
        prompts, out, version = self._collect(source, state)
        state.prompts = prompts
        self._launch(source, state, state.step + 1)  # overlaps with this step's scoring and training
        out.batch[VERSION_KEY] = torch.full((len(out),), version, dtype=torch.long)
        with state.timed("reward"):
            batch = out.union(source.score(out))
        batch, metrics = drop_stale(batch, source.version, self.max_staleness)
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
        atomic_save(self.ready, path)
        return {"generated_ahead": path.name}

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        self.in_flight = None
        name = state.get("generated_ahead")
        self.ready = torch.load(directory / name, weights_only=False) if name else None


class AsyncStream:
    """A stream of samples from the rollout's own pool, one chunk always in flight (see the module's text)."""

    def __init__(self, max_staleness: int = 1, partial_rollout_tokens: int | None = None,
                 max_in_flight: int | None = None) -> None:
        for name, value in (("partial_rollout_tokens", partial_rollout_tokens), ("max_in_flight", max_in_flight)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        self.max_staleness, self.max_in_flight = max_staleness, max_in_flight
        self.partial_rollout_tokens = partial_rollout_tokens
        self.stream: SampleStream | None = None  # made at the first step, from the rollout's sampling settings
        self.saved_stream: dict[str, Any] | None = None  # a checkpoint's, until the stream is made
        self.in_flight = None  # (the chunk call's future, its samples, the weights' version)
        self.weights_version: int | None = None  # the policy version the rollout holds; None: not sent yet
        self.chunks = 0  # chunk calls made; each one's sampling seed

    def _stream(self, source: RolloutSource) -> SampleStream:
        if self.stream is None:
            sampling = source.sampling
            chunk = self.partial_rollout_tokens or sampling.max_new_tokens
            self.stream = SampleStream(source.batch_size, sampling.n, sampling.max_new_tokens, chunk,
                                       self.max_staleness, source.pad_token_id, self.max_in_flight)
        if self.saved_stream is not None:
            self.stream.load_state_dict(self.saved_stream)
            self.saved_stream = None
        return self.stream

    def rollout(self, source: RolloutSource, state: StepState) -> DataProto:
        stream, version = self._stream(source), source.version
        dropped_before = stream.dropped_samples
        if self.weights_version != version:  # an update (or a resume) since the rollout's weights were sent
            self._finish_chunk(source, state)  # the chunk in flight ends under the old weights ...
            state.metrics["stream/interrupted_samples"] = float(stream.partial_samples())
            source.record_rollout_metrics(state, source.sync_weights())  # ... and the rest under these
            self.weights_version = version
        stream.drop_stale(version)
        while not stream.has_batch():
            if self.in_flight is None and not self._launch(source, state):
                raise RuntimeError(f"the sample stream is stuck: no group can start at version {version} "
                                   f"and only {len(stream.ready)} of the batch's {source.batch_size} are ready")
            self._finish_chunk(source, state)
            stream.drop_stale(version)
        out, state.prompts = stream.take_batch()
        self._launch(source, state)  # generation goes on while this batch is scored and trained on
        return scored_stream_batch(source, state, out, version, self.max_staleness,
                                   stream.dropped_samples - dropped_before, stream.metrics())

    def _launch(self, source: RolloutSource, state: StepState) -> bool:
        """Draw the prompts that may start, and send the next chunk; False when nothing is left to generate."""
        stream, version = self.stream, source.version
        while stream.wants_prompts(version):
            stream.add_prompts(source.next_prompts(state))
        chunk = stream.next_chunk(version)
        if chunk is None:
            return False
        chunk.meta_info["sampling"]["seed"] = generation_seed(source.seed, self.chunks)
        self.chunks += 1
        future = source.submit("generate_chunk", chunk)
        self.in_flight = (future, list(stream.generating), self.weights_version)
        return True

    def _finish_chunk(self, source: RolloutSource | None, state: StepState | None) -> None:
        if self.in_flight is None:
            return
        future, sent, version = self.in_flight
        if state is not None:
            with state.timed("wait_rollout"):  # what generation did not hide behind training
                out = future.result()
            source.record_rollout_metrics(state, out.meta_info.pop("metrics", {}))
        else:
            out = future.result()
        self.in_flight = None
        self.stream.add_chunk(sent, out, version)

    # ----------------------------------------------------------- checkpoint
    def state_dict(self, path: Path) -> dict[str, Any]:
        """Waits for the chunk in flight, then writes the stream to ``path``."""
        if self.stream is None:
            return {}
        self._finish_chunk(None, None)
        atomic_save({"stream": self.stream.state_dict(), "weights_version": self.weights_version,
                      "chunks": self.chunks}, path)
        return {"stream": path.name}

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        self.in_flight = None
        if not state.get("stream"):
            return
        saved = torch.load(directory / state["stream"], weights_only=False)
        self.weights_version, self.chunks = saved["weights_version"], saved["chunks"]
        if self.stream is not None:
            self.stream.load_state_dict(saved["stream"])
        else:
            self.saved_stream = saved["stream"]


def build_schedule(mode: str, max_staleness: int, partial_rollout_tokens: int | None = None,
                   max_in_flight: int | None = None):
    if mode == "sync":
        return SyncSchedule()
    if mode == "one_step_off":
        return OneStepOff(max_staleness)
    if mode == "async":
        return AsyncStream(max_staleness, partial_rollout_tokens, max_in_flight)
    raise ValueError(f"trainer.mode {mode!r} is not one of {TRAINER_MODES}")


def atomic_save(value: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, then renamed into place: a crash leaves the old file or none."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(value, tmp)
    tmp.replace(path)


def with_sampling(prompts: DataProto, sampling: dict[str, Any]) -> DataProto:
    """``prompts`` with ``sampling`` (SamplingConfig fields over the rollout's) for the rollout to apply."""
    return DataProto(prompts.batch, prompts.non_tensor_batch, {**prompts.meta_info, "sampling": sampling})
