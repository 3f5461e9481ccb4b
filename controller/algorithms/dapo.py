"""DAPO (Yu et al. 2025): dynamic sampling and overlong reward shaping, on GRPO with clip-higher.

DAPO's loss needs nothing new (the decoupled clip is ``ppo.clip_ratio_low`` / ``clip_ratio_high``,
0.2 / 0.28 by default, and the loss is the token mean); its two hooks act after scoring:

- **Overlong shaping** (eq. 13): a response longer than L_max - L_buffer loses, linearly, up to
  ``overlong_penalty_factor`` of reward over the last ``overlong_buffer_len`` tokens before L_max,
  the maximum response length; it is added to the score on the response's last token.
- **Dynamic sampling**: a prompt group whose rewards are all equal has zero advantage under the
  group baseline, so it only dilutes the batch. Such groups are dropped and more prompts are
  generated, up to ``algorithm.max_gen_batches`` generation rounds in all, until the batch holds
  ``data.batch_size`` informative groups; the surplus is cut. If the rounds run out first, the batch
  is filled with dropped groups (zero advantage, so no gradient), and ``dapo/filled_groups`` says how
  many: the step keeps its size and its PPO mini-batch layout.

The two pure functions, ``overlong_penalty`` and ``informative_groups``, are what the tests check by
hand; ``DAPO`` is the hooks object.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from controller.algorithms.advantages import group_rows
from controller.algorithms.algorithm import RLAlgorithm, StepState, register_algorithm
from workers.data_proto import DataProto
from workers.rollout.batch import concat_rollout_batches

__all__ = ["DAPO", "informative_groups", "overlong_penalty"]


def overlong_penalty(response_lengths: torch.Tensor, max_length: int, buffer_len: int, penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment per response: 0 up to ``max_length - buffer_len`` tokens, then
    -penalty_factor * (length - (max_length - buffer_len)) / buffer_len, reaching -penalty_factor at
    ``max_length``. ``buffer_len`` 0 turns it off (all zeros)."""
    if buffer_len < 0 or buffer_len > max_length:
        raise ValueError(f"overlong_buffer_len must be in [0, max_length = {max_length}], got {buffer_len}")
    lengths = response_lengths.to(torch.float32)
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    exceed = (lengths - (max_length - buffer_len)).clamp(min=0)
    return -(exceed / buffer_len).clamp(max=1.0) * penalty_factor


def informative_groups(group_index: Sequence[Hashable], scores: torch.Tensor) -> tuple[list[Hashable], list[Hashable]]:
    """(groups whose scores differ, groups whose scores are all equal), each in first-seen order.

    A group of one sample has no spread and counts as uninformative.
    """
    keep, drop = [], []
    for gid, rows in group_rows(group_index).items():
        values = scores[torch.tensor(rows)]
        (keep if len(rows) > 1 and bool((values != values[0]).any()) else drop).append(gid)
    return keep, drop


@register_algorithm("dapo", preset="dapo")
class DAPO(RLAlgorithm):
    @property
    def dynamic_sampling(self) -> bool:
        value = self.config.dynamic_sampling
        return self.defaults.dynamic_sampling if value is None else value

    def buffer_len(self, max_length: int) -> int:
        value = self.config.overlong_buffer_len
        return int(max_length * self.defaults.overlong_buffer_fraction) if value is None else value

    def after_scoring(self, ctx, state: StepState, batch: DataProto) -> DataProto:
        batch = self.shape_overlong(ctx, self._tag_round(batch, 0))
        if not self.dynamic_sampling:
            return self._report_overlong(ctx, state, batch)
        wanted = len(state.prompts)
        rounds, parts = 1, [batch]
        kept, dropped = informative_groups(batch.non_tensor_batch["uid"], batch.batch["scores"])
        while len(kept) < wanted and rounds < self.config.max_gen_batches:
            more = ctx.generate_and_score(ctx.loader.next_batch(), state, round_index=rounds)
            more = self.shape_overlong(ctx, self._tag_round(more, rounds))
            more_kept, more_dropped = informative_groups(more.non_tensor_batch["uid"], more.batch["scores"])
            kept, dropped, rounds = kept + more_kept, dropped + more_dropped, rounds + 1
            parts.append(more)
        chosen = (kept + dropped)[:wanted]
        state.metrics.update({"dapo/filtered_groups": float(len(dropped)), "dapo/gen_batches": float(rounds),
                              "dapo/filled_groups": float(max(0, wanted - len(kept)))})
        every = concat_rollout_batches(parts, ctx.pad_token_id) if len(parts) > 1 else batch
        rows = group_rows(every.non_tensor_batch["uid"])
        return self._report_overlong(ctx, state, every[[row for gid in chosen for row in rows[gid]]])

    def shape_overlong(self, ctx, batch: DataProto) -> DataProto:
        """The overlong penalty added to each response's score, on its last token."""
        max_length = ctx.max_response_length
        buffer_len = self.buffer_len(max_length)
        if buffer_len == 0:
            return batch
        mask = batch.batch["response_mask"]
        lengths = mask.sum(-1)
        penalty = overlong_penalty(lengths, max_length, buffer_len, self.config.overlong_penalty_factor)
        scores = batch.batch["token_level_scores"].clone()
        last = (lengths - 1).clamp(min=0)
        rows = torch.arange(len(batch))
        scores[rows, last] += penalty.to(scores.dtype) * (lengths > 0)
        batch.batch["token_level_scores"] = scores
        batch.batch["scores"] = batch.batch["scores"] + penalty.to(batch.batch["scores"].dtype)
        return batch

    def _report_overlong(self, ctx, state: StepState, batch: DataProto) -> DataProto:
        max_length = ctx.max_response_length
        buffer_len = self.buffer_len(max_length)
        if buffer_len:
            lengths = batch.batch["response_mask"].sum(-1)
            penalty = overlong_penalty(lengths, max_length, buffer_len, self.config.overlong_penalty_factor)
            state.metrics.update({"dapo/overlong_penalty/mean": float(penalty.mean()),
                                  "dapo/overlong_frac": float((penalty < 0).float().mean())})
        return batch

    @staticmethod
    def _tag_round(batch: DataProto, round_index: int) -> DataProto:
        """Group ids made unique per generation round (two rounds may draw the same prompt)."""
        uid = np.asarray([f"r{round_index}/{u}" for u in batch.non_tensor_batch["uid"]], dtype=object)
        return DataProto(batch.batch, {**batch.non_tensor_batch, "uid": uid}, batch.meta_info)
