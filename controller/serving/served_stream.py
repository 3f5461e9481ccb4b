"""``trainer.mode: async`` with the user's agent on the rollout server: the replicas serve across steps, and the
weights change under the sessions in flight.

- At the first step the actor's weights go to the rollout's pool and its replicas start serving; they serve
  until the run ends, behind one OpenAI-compatible endpoint.
- A prompt group (a prompt's ``n`` sessions) starts while it can still be trained within
  ``trainer.max_staleness`` updates: at most ``batch_size x (1 + max_staleness)`` groups are running or
  complete-but-untrained at once.
- A step trains on the ``batch_size`` complete groups that started first, and new groups start at once, so
  the agents run while the actor trains.
- After each update the actor sends its weights and every replica takes them in flight (``POST /update``):
  with ``rollout.server_update: pause`` the requests in flight go on under the new weights, each token tagged
  with the policy version that sampled it (``token_versions``); with ``finish`` they end under the old
  weights first. A sample's ``policy_version`` is its oldest token's.
- A complete group that can no longer be trained in time (it started more than ``max_staleness`` updates
  ago) is dropped and counted (``staleness/dropped``), as the built-in stream (``AsyncStream``) drops its own.
- A checkpoint lets the running groups finish, then saves the complete ones and the prompts drawn but not
  started: a resumed run trains on them first, and starts the rest, losing and repeating no prompt.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from controller.rl.schedules import atomic_save, generation_seed, scored_stream_batch
from controller.serving.served_rollout import ServedPart, ServedReplicas, ServedRollout, joined_prompts
from workers.data_proto import DataProto

if TYPE_CHECKING:
    from controller.algorithms import StepState
    from controller.rl.rollout_source import RolloutSource

__all__ = ["ServedStream"]


@dataclass
class _Group:
    index: int  # the order groups started in (its sessions' seed and names)
    version: int  # the trainer's version when it started: its samples' tokens are this or newer
    prompts: DataProto  # the prompt's row
    future: Future | None = None  # its sessions, on the stream's event loop
    part: ServedPart | None = None  # once complete


def _prompt_row(prompts: DataProto, row: int, group: int) -> DataProto:
    """Row ``row`` of a loader batch, its left padding cut, its ``uid`` made the group's own (a prompt drawn
    again in a later epoch is another group)."""
    keep = prompts.batch["attention_mask"][row].bool()
    tensors = {"input_ids": prompts.batch["input_ids"][row][keep][None], "attention_mask": prompts.batch[
        "attention_mask"][row][keep][None]}
    fields = {key: values[row:row + 1] for key, values in prompts.non_tensor_batch.items()}
    if "uid" in fields:
        fields["uid"] = np.asarray([f"g{group}/{fields['uid'][0]}"], dtype=object)
    return DataProto(tensors, fields, dict(prompts.meta_info))


class ServedStream:
    """The served rollout of an async run (see the module's text)."""

    def __init__(self, served: ServedRollout, max_staleness: int, update_policy: str = "pause") -> None:
        self.served, self.max_staleness, self.update_policy = served, max_staleness, update_policy
        self.replicas: ServedReplicas | None = None
        self.server = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.gate: asyncio.Semaphore | None = None
        self.sampling = served.config.sampling
        self.version_of: list[int] = []  # the replicas' version k holds the trainer's version_of[k]
        self.queued: list[DataProto] = []  # prompt rows drawn from the loader, not started yet
        self.running: list[_Group] = []
        self.ready: list[_Group] = []  # complete, in the order they started
        self.started = self.trained = self.dropped = self.dropped_samples = 0
        self.serving_since = 0.0

    @property
    def serving(self) -> bool:
        return self.replicas is not None

    # ---------------------------------------------------------------- a step
    def rollout(self, source: RolloutSource, state: StepState) -> DataProto:
        version, size = source.version, source.batch_size
        if self.replicas is None:
            self._start(source, state)
        else:  # after an update the replicas take the new weights in flight
            source.record_rollout_metrics(state, self.take_weights(source.sync_weights, version))
        self._collect()
        dropped_before = self.dropped_samples
        self._drop_stale(version)
        self._launch(source, state, version)
        with state.timed("wait_rollout"):  # what the sessions did not hide behind the previous step
            while len(self.ready) < size:
                if not self.running:
                    raise RuntimeError(f"the served stream is stuck at version {version}: {len(self.ready)} of the "
                                       f"batch's {size} groups are complete and none is running")
                wait([g.future for g in self.running], return_when=FIRST_COMPLETED)
                self._collect()
        groups, self.ready = self.ready[:size], self.ready[size:]
        self.trained += len(groups)
        self._launch(source, state, version)  # the agents go on while this batch is scored and trained on
        state.prompts = joined_prompts([g.prompts for g in groups], source.pad_token_id or 0)
        oldest = min(g.version for g in groups)
        batch = self.served.assemble([g.part for g in groups], True, self.sampling, versioned=True,
                                     default_version=oldest)
        metrics = batch.meta_info.pop("metrics")
        seconds = time.perf_counter() - self.serving_since
        metrics["agent/sessions_per_s"] = self.trained * self.sampling.n / seconds if seconds > 0 else 0.0
        source.record_rollout_metrics(state, metrics)
        return scored_stream_batch(source, state, batch, version, self.max_staleness,
                                   self.dropped_samples - dropped_before, self.metrics())

    def metrics(self) -> dict[str, float]:
        return {"stream/groups_drawn": float(self.started + len(self.queued)),
                "stream/groups_trained": float(self.trained), "stream/groups_dropped": float(self.dropped),
                "stream/groups_in_generation": float(len(self.running)), "stream/groups_ready": float(len(self.ready)),
                "stream/weight_updates": float(len(self.version_of) - 1)}

    # ---------------------------------------------------------------- serving
    def _start(self, source: RolloutSource, state: StepState) -> None:
        source.record_rollout_metrics(state, source.sync_weights())  # the rollout's pool is idle: a plain sync
        self.replicas = ServedReplicas(self.served.group, self.served.api_key).start()
        self.version_of = [source.version]
        self.server = self.served.server(self.replicas, self.sampling).start()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hybridflow-served-stream", daemon=True)
        self.thread.start()

        async def make_gate() -> asyncio.Semaphore:
            return asyncio.Semaphore(self.served.config.agent.max_concurrent_sessions)

        self.gate = asyncio.run_coroutine_threadsafe(make_gate(), self.loop).result()
        self.serving_since = time.perf_counter()

    def take_weights(self, sync_weights, version: int) -> dict[str, float]:
        """The actor's weights (the trainer's ``version``) into every replica while it serves, unless they are
        there: the link's transfer (``sync_weights``, a RolloutSource's), received by ``POST /update``."""
        if self.version_of[-1] == version:
            return {}
        answers: list[dict[str, Any]] = []

        def receive() -> list[dict[str, Any]]:
            answers.extend(self.replicas.update(self.update_policy))
            return answers

        metrics = sync_weights(receive)
        if answers:
            expected = len(self.version_of)
            if any(a.get("version") != expected for a in answers):
                raise RuntimeError(f"the replicas answered versions {[a.get('version') for a in answers]} to "
                                   f"update {expected}")
            self.version_of.append(version)
            metrics = {**metrics, "stream/update_wait_s": max(a.get("update/wait_s", 0.0) for a in answers),
                       "stream/requests_paused": float(sum(a.get("update/requests_paused", 0) for a in answers))}
        return metrics

    def _launch(self, source: RolloutSource, state: StepState, version: int) -> None:
        """Start groups while each can be trained within ``max_staleness`` updates."""
        limit = source.batch_size * (1 + self.max_staleness)
        while len(self.running) + len(self.ready) < limit:
            if not self.queued:
                prompts = source.next_prompts(state)
                self.queued = [_prompt_row(prompts, i, self.started + i) for i in range(len(prompts))]
            row = self.queued.pop(0)
            group = _Group(self.started, version, row)
            self.started += 1
            sampling = self.served.sampling(row, {"seed": generation_seed(source.seed, 0, group.index)})
            coroutine = self.served.sessions(row, sampling, self.server, f"g{group.index}", self.gate)
            group.future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
            self.running.append(group)

    def _collect(self) -> None:
        """Complete groups into ``ready`` (in the order they started), their tokens' versions the trainer's."""
        done = [g for g in self.running if g.future.done()]
        for group in done:
            group.part, group.future = group.future.result(), None
            for outcome in group.part.outcomes:
                for turn in outcome.turns:
                    turn.versions = [self.version_of[v] if v >= 0 else -1 for v in turn.versions]
        self.running = [g for g in self.running if g.future is not None]
        self.ready = sorted(self.ready + done, key=lambda g: g.index)

    def _drop_stale(self, version: int) -> None:
        stale = [g for g in self.ready if version - g.version > self.max_staleness]
        if stale:
            self.ready = [g for g in self.ready if version - g.version <= self.max_staleness]
            self.dropped += len(stale)
            self.dropped_samples += sum(len(g.part.outcomes) for g in stale)

    def generate_now(self, prompts: DataProto, overrides: dict[str, Any]) -> DataProto:
        """A batch of ``prompts`` on the serving replicas, outside the stream (validation), on an endpoint of
        its own with the call's sampling."""
        start = time.perf_counter()
        sampling = self.served.sampling(prompts, overrides)
        server = self.served.server(self.replicas, sampling).start()
        try:
            coroutine = self.served.sessions(prompts, sampling, server, f"val{self.started}")
            part = asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()
        finally:
            server.close()
        batch = self.served.assemble([part], False, sampling)
        metrics = batch.meta_info["metrics"]
        metrics.update(self.served.serving_metrics(time.perf_counter() - start, metrics, [], []))
        return batch

    def close(self) -> None:
        """Stop the sessions in flight and the serving (the end of the run)."""
        if self.replicas is None:
            return
        for group in self.running:
            group.future.cancel()
        wait([g.future for g in self.running], timeout=30)
        self.running = []
        self.server.close()
        self.replicas.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.replicas = self.server = self.loop = self.thread = self.gate = None

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self, path: Path) -> dict[str, Any]:
        """Lets the running groups finish (no new one starts), then writes the complete groups and the prompts
        drawn but not started to ``path``."""
        if self.running:
            wait([g.future for g in self.running])
            self._collect()
        if not (self.ready or self.queued or self.started):
            return {}
        groups = [(g.index, g.version, g.prompts, g.part) for g in self.ready]
        atomic_save({"ready": groups, "queued": self.queued, "counts": (self.started, self.trained, self.dropped,
                                                                         self.dropped_samples)}, path)
        return {"served_stream": path.name}

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        if not state.get("served_stream"):
            return
        saved = torch.load(directory / state["served_stream"], weights_only=False)
        self.ready = [_Group(index, version, prompts, None, part) for index, version, prompts, part in saved["ready"]]
        self.queued = saved["queued"]
        self.started, self.trained, self.dropped, self.dropped_samples = saved["counts"]

