"""SFT examples into training batches, in a rollout's row layout, and the loader that walks them in epochs.

A batch is what the actor's update reads from a rollout: prompts left-padded to the batch's longest,
responses right-padded, ``response_mask`` the loss mask (0 on padding and on tokens that are context),
``attention_mask`` and ``position_ids`` over every real token. The loader's position (epoch, offset) is
its whole state: a resumed run draws exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from controller.data.images import ImageProcessing
from controller.data.sft_examples import SFTExample
from workers.data_proto import DataProto
from workers.multimodal import MULTI_MODAL_INPUTS

__all__ = ["collate_sft", "SFTLoader"]


def collate_sft(examples: Sequence[SFTExample], pad_token_id: int, images: ImageProcessing | None = None) -> DataProto:
    """The examples as one batch; with ``images`` (a vision-language model's processing), the examples' images as
    the vision tower's inputs (``multi_modal_inputs``)."""
    prompt_width = max(len(e.prompt_ids) for e in examples)
    response_width = max(len(e.response_ids) for e in examples)
    b = len(examples)
    prompts = torch.full((b, prompt_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(b, prompt_width, dtype=torch.long)
    responses = torch.full((b, response_width), pad_token_id, dtype=torch.long)
    response_attention = torch.zeros(b, response_width, dtype=torch.long)
    loss_mask = torch.zeros(b, response_width, dtype=torch.long)
    for i, e in enumerate(examples):
        p, r = len(e.prompt_ids), len(e.response_ids)
        prompts[i, prompt_width - p:] = torch.tensor(e.prompt_ids)
        prompt_mask[i, prompt_width - p:] = 1
        responses[i, :r] = torch.tensor(e.response_ids)
        response_attention[i, :r] = 1
        loss_mask[i, :r] = torch.tensor(e.loss_mask)
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    fields = {}
    if images is not None and any(e.images for e in examples):
        fields[MULTI_MODAL_INPUTS] = [images.inputs(e.images) if e.images else None for e in examples]
    return DataProto({
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": loss_mask,
    }, fields)


class SFTLoader:
    """Batches of ``batch_size`` examples, reshuffled every epoch (seeded); a partial last batch is skipped."""

    def __init__(self, examples: Sequence[SFTExample], batch_size: int, pad_token_id: int, shuffle: bool = True,
                 seed: int = 0, images: ImageProcessing | None = None) -> None:
        if not 1 <= batch_size <= len(examples):
            raise ValueError(f"batch_size {batch_size} must be between 1 and the {len(examples)} examples")
        self.examples, self.batch_size, self.pad_token_id = list(examples), batch_size, pad_token_id
        self.images = images
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> DataProto:
        if self.position + self.batch_size > len(self.examples):
            self.epoch, self.position = self.epoch + 1, 0
        rows = self._order()[self.position: self.position + self.batch_size]
        self.position += self.batch_size
        return collate_sft([self.examples[i] for i in rows], self.pad_token_id, self.images)

    def batches(self) -> list[DataProto]:
        """Every example once, in order, in batches (the last may be smaller): for validation."""
        return [collate_sft(self.examples[i: i + self.batch_size], self.pad_token_id, self.images)
                for i in range(0, len(self.examples), self.batch_size)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
