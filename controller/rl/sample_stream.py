"""The sample stream of ``trainer.mode: async``: prompts in, partial rollouts, ready prompt groups out.

Pure bookkeeping, with no worker and no process group, so every rule here is tested on its own
(``controller.rl.schedules.AsyncStream`` drives it against the rollout pool):

* **Admission** (the staleness bound, as AReaL bounds its rollouts). Training consumes ``batch_size``
  groups per update, so a group admitted at policy version ``v`` as the ``g``-th group (0-based) is
  trained about ``g // batch_size - v`` updates stale. A group is admitted only while that stays within
  ``max_staleness``; ``max_in_flight`` caps the groups in generation at once (the rollout's memory).
* **Chunks.** Every sample in generation advances by at most ``chunk_tokens`` tokens per rollout call.
  Between two calls the rollout may receive new weights: a sample in the middle of its response then
  continues under them (a partial rollout), and ``token_versions`` keeps the policy version of each of
  its tokens.
* **Groups.** A sample ends at EOS, a stop string, or ``max_new_tokens``; a prompt's group is ready once
  all of its ``n`` samples have ended. Batches take the oldest ready groups.
* **Staleness.** A sample's ``policy_version`` is that of its oldest token. A group more than
  ``max_staleness`` updates behind the trainer is not trained on: it is dropped, ready or still in
  generation, and counted (``staleness/dropped``, in samples).

Every group drawn is trained once or dropped once; ``state_dict`` holds everything in between (the
prompts drawn but not started, the samples in generation with their tokens so far, the ready groups),
so a resumed run continues the stream without losing or repeating a sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workers.data_proto import DataProto
from workers.rollout.batch import sequence_tensors

__all__ = ["Sample", "SampleStream", "mixed_version_samples"]


@dataclass
class Sample:
    """One response in the stream: sample ``index`` of prompt group ``group``."""

    group: int
    index: int
    prompt_ids: list[int]
    fields: dict[str, Any]  # the prompt's non-tensor fields (uid made unique to the group)
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version that generated each token
    finish_reason: str | None = None  # None while in generation

    @property
    def policy_version(self) -> int:
        return min(self.versions)


def mixed_version_samples(token_versions: torch.Tensor) -> int:
    """Rows of ``token_versions`` (-1 on padding) whose tokens come from more than one policy version."""
    newest = token_versions.max(-1).values
    oldest = token_versions.masked_fill(token_versions < 0, torch.iinfo(token_versions.dtype).max).min(-1).values
    return int((newest > oldest).sum())


class SampleStream:
    def __init__(self, batch_size: int, n: int, max_new_tokens: int, chunk_tokens: int, max_staleness: int,
                 pad_token_id: int, max_in_flight: int | None = None) -> None:
        problems = [f"{name} must be >= {low}, got {value}" for name, value, low in (
            ("batch_size", batch_size, 1), ("n", n, 1), ("max_new_tokens", max_new_tokens, 1),
            ("chunk_tokens", chunk_tokens, 1), ("max_staleness", max_staleness, 0),
            ("max_in_flight", max_in_flight if max_in_flight is not None else 1, 1)) if value < low]
        if problems:
            raise ValueError("invalid sample stream: " + "; ".join(problems))
        self.batch_size, self.n, self.max_new_tokens = batch_size, n, max_new_tokens
        self.chunk_tokens, self.max_staleness, self.max_in_flight = chunk_tokens, max_staleness, max_in_flight
        self.pad_token_id = pad_token_id
        self.pending: list[tuple[int, list[int], dict[str, Any]]] = []  # drawn, not started: (group, prompt, fields)
        self.generating: list[Sample] = []
        self.waiting: dict[int, list[Sample]] = {}  # ended samples of groups with samples still in generation
        self.ready: list[list[Sample]] = []  # complete groups, oldest first
        self.drawn = self.trained = self.dropped = 0  # groups
        self.dropped_samples = 0
        self.temperature: float | None = None  # the rollout's log-prob temperature, from its first chunk

    # ------------------------------------------------------------- admission
    def room(self, version: int) -> int:
        """How many more groups may start generating at policy ``version`` (the trainer's update count)."""
        started = self.drawn - len(self.pending)  # trained, dropped, or still in the stream
        bound = (version + self.max_staleness + 1) * self.batch_size - (started - self.dropped)
        if self.max_in_flight is not None:
            bound = min(bound, self.max_in_flight - self.groups_in_generation())
        return max(bound, 0)

    def groups_in_generation(self) -> int:
        return len({s.group for s in self.generating} | set(self.waiting))

    def wants_prompts(self, version: int) -> bool:
        """Whether the prompts drawn so far are fewer than may start now: draw another loader batch."""
        return len(self.pending) < self.room(version)

    def add_prompts(self, prompts: DataProto) -> None:
        """A loader batch (left-padded ``input_ids`` + ``attention_mask``, non-tensor fields) joins the queue."""
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        for row in range(len(prompts)):
            fields = {key: values[row] for key, values in prompts.non_tensor_batch.items()}
            fields["uid"] = f"g{self.drawn}/{fields.get('uid', row)}"  # a prompt drawn twice is two groups
            self.pending.append((self.drawn, ids[row][mask[row]].tolist(), fields))
            self.drawn += 1

    # ---------------------------------------------------------------- chunks
    def next_chunk(self, version: int) -> DataProto | None:
        """Start the admitted groups, drop those already past the bound; the rollout's next call (or None).

        The rows are ``self.generating`` in order: ``prompts`` / ``prompt_mask`` left-padded, the responses so
        far right-padded to ``max_new_tokens``, ``meta_info["sampling"]["max_new_tokens"]`` the chunk.
        """
        room = self.room(version)
        for group, prompt, fields in self.pending[:room]:
            self.generating += [Sample(group, j, prompt, fields) for j in range(self.n)]
        self.pending = self.pending[room:]
        self.drop_stale(version)
        if not self.generating:
            return None
        padded = self._padded(self.generating)
        padded.pop("token_versions")
        return DataProto(padded, meta_info={"sampling": {"max_new_tokens": self.chunk_tokens}})

    def _padded(self, rows: list[Sample]) -> dict[str, torch.Tensor]:
        """``rows``' prompts left-padded (``prompts``, ``prompt_mask``) and their tokens so far right-padded to
        max_new_tokens (``responses``, ``response_mask``, ``rollout_log_probs``, ``token_versions``: -1 on padding)."""
        prompt_width, width = max(len(s.prompt_ids) for s in rows), self.max_new_tokens
        out = {"prompts": torch.full((len(rows), prompt_width), self.pad_token_id, dtype=torch.long),
               "prompt_mask": torch.zeros(len(rows), prompt_width, dtype=torch.long),
               "responses": torch.full((len(rows), width), self.pad_token_id, dtype=torch.long),
               "response_mask": torch.zeros(len(rows), width, dtype=torch.long),
               "rollout_log_probs": torch.zeros(len(rows), width),
               "token_versions": torch.full((len(rows), width), -1, dtype=torch.long)}
        for row, sample in enumerate(rows):
            out["prompts"][row, prompt_width - len(sample.prompt_ids):] = torch.tensor(sample.prompt_ids)
            out["prompt_mask"][row, prompt_width - len(sample.prompt_ids):] = 1
            if sample.tokens:
                length = len(sample.tokens)
                out["responses"][row, :length] = torch.tensor(sample.tokens, dtype=torch.long)
                out["response_mask"][row, :length] = 1
                out["rollout_log_probs"][row, :length] = torch.tensor(sample.log_probs)
                out["token_versions"][row, :length] = torch.tensor(sample.versions, dtype=torch.long)
        return out

    def add_chunk(self, sent: list[Sample], out: DataProto, version: int) -> None:
        """The rollout's answer to a chunk of ``sent`` (``self.generating`` when it was made), generated at ``version``."""
        if len(out) != len(sent):
            raise RuntimeError(f"the rollout returned {len(out)} rows for a chunk of {len(sent)} samples")
        self.temperature = out.meta_info.get("temperature", self.temperature)
        lengths = out.batch["response_mask"].sum(-1).tolist()
        finished = out.batch["finished"].tolist()
        for row, sample in enumerate(sent):
            begin, end = len(sample.tokens), int(lengths[row])
            sample.tokens += out.batch["responses"][row, begin:end].tolist()
            sample.log_probs += out.batch["rollout_log_probs"][row, begin:end].tolist()
            sample.versions += [version] * (end - begin)
            if finished[row]:
                sample.finish_reason = out.non_tensor_batch["finish_reason"][row]
        ended = {id(s) for s in sent if s.finish_reason is not None}
        self.generating = [s for s in self.generating if id(s) not in ended]
        for sample in sent:
            if id(sample) in ended:
                self.waiting.setdefault(sample.group, []).append(sample)
        for group in sorted(g for g, done in self.waiting.items() if len(done) == self.n):
            self.ready.append(sorted(self.waiting.pop(group), key=lambda s: s.index))

    def partial_samples(self) -> int:
        """Samples in the middle of their response: those a weight update now interrupts."""
        return sum(1 for s in self.generating if s.tokens)

    # -------------------------------------------------------------- staleness
    def _group_version(self, group: int) -> int | None:
        versions = [s.policy_version for s in self.generating + self.waiting.get(group, [])
                    if s.group == group and s.versions]
        return min(versions) if versions else None

    def drop_stale(self, version: int) -> int:
        """Drop the groups, ready or in generation, more than max_staleness behind ``version``; samples dropped."""
        limit = version - self.max_staleness
        stale_ready = [g for g in self.ready if min(s.policy_version for s in g) < limit]
        in_generation = {s.group for s in self.generating} | set(self.waiting)
        stale_groups = {g for g in in_generation if (v := self._group_version(g)) is not None and v < limit}
        dropped = sum(len(g) for g in stale_ready) + self.n * len(stale_groups)
        self.ready = [g for g in self.ready if g not in stale_ready]
        self.generating = [s for s in self.generating if s.group not in stale_groups]
        for group in stale_groups:
            self.waiting.pop(group, None)
        self.dropped += len(stale_ready) + len(stale_groups)
        self.dropped_samples += dropped
        return dropped

    # ---------------------------------------------------------------- batches
    def has_batch(self) -> bool:
        return len(self.ready) >= self.batch_size

    def take_batch(self) -> tuple[DataProto, DataProto]:
        """The oldest ``batch_size`` ready groups as a rollout batch (prompt-major, as ``build_rollout_batch``
        lays it out) with ``policy_version`` [B] and ``token_versions`` [B, max_new_tokens] (-1 on padding);
        and their prompts as the loader gave them (left-padded ``input_ids``, ``attention_mask``, fields)."""
        if not self.has_batch():
            raise RuntimeError(f"{len(self.ready)} ready groups, fewer than the batch's {self.batch_size}")
        groups, self.ready = self.ready[:self.batch_size], self.ready[self.batch_size:]
        self.trained += len(groups)
        rows = [s for g in groups for s in g]
        padded = self._padded(rows)
        prompts, prompt_mask, response_mask = padded["prompts"], padded["prompt_mask"], padded["response_mask"]
        tensors = sequence_tensors(prompts, prompt_mask, padded["responses"], response_mask, response_mask,
                                   padded["rollout_log_probs"])
        tensors["token_versions"] = padded["token_versions"]
        tensors["policy_version"] = torch.tensor([s.policy_version for s in rows], dtype=torch.long)
        fields = {key: [s.fields[key] for s in rows] for key in rows[0].fields}
        fields["finish_reason"] = [s.finish_reason for s in rows]
        meta = {"temperature": self.temperature} if self.temperature is not None else {}
        firsts = [g[0] for g in groups]
        prompt_rows = torch.tensor([row * self.n for row in range(len(groups))])
        prompt_batch = DataProto({"input_ids": prompts[prompt_rows], "attention_mask": prompt_mask[prompt_rows]},
                                 {key: [s.fields[key] for s in firsts] for key in firsts[0].fields})
        return DataProto(tensors, fields, meta), prompt_batch

    def metrics(self) -> dict[str, float]:
        """Where the stream stands: groups drawn, trained, dropped, and in between."""
        return {"stream/groups_drawn": float(self.drawn), "stream/groups_trained": float(self.trained),
                "stream/groups_dropped": float(self.dropped), "stream/groups_pending": float(len(self.pending)),
                "stream/groups_in_generation": float(self.groups_in_generation()),
                "stream/groups_ready": float(len(self.ready))}

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything between the loader and training (call with no chunk in flight)."""
        return {"pending": self.pending, "generating": self.generating, "waiting": self.waiting, "ready": self.ready,
                "drawn": self.drawn, "trained": self.trained, "dropped": self.dropped,
                "dropped_samples": self.dropped_samples, "temperature": self.temperature}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending, self.generating = list(state["pending"]), list(state["generating"])
        self.waiting, self.ready = dict(state["waiting"]), list(state["ready"])
        self.drawn, self.trained, self.dropped = int(state["drawn"]), int(state["trained"]), int(state["dropped"])
        self.dropped_samples, self.temperature = int(state["dropped_samples"]), state["temperature"]
