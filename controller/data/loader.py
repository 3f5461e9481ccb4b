"""A prompt dataloader that can resume mid-epoch.

Batches are DataProtos of left-padded ``input_ids`` / ``attention_mask``
with, per prompt, the non-tensor fields ``ground_truth``, ``uid`` (the group
id of its n samples), ``prompt_text`` (the prompt as rendered, chat template
included), ``messages`` (the prompt as chat messages, system prompt
included), ``data_source`` and ``extra_info``; a vision-language batch adds
each prompt's images (``workers.multimodal``). They travel with the samples
through the rollout to the reward function, which gets all but
``ground_truth`` in its ``extra`` argument.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from controller.data.chat_template import PromptFormat, encode_prompts
from controller.data.dataset import PromptDataset
from controller.data.images import ImageProcessing
from controller.data.overlong import drop_or_refuse_overlong
from workers.data_proto import DataProto
from workers.multimodal import MULTI_MODAL_DATA, MULTI_MODAL_INPUTS

__all__ = ["PromptLoader", "prompt_messages"]


def prompt_messages(data: PromptDataset, row: int) -> list[dict[str, Any]]:
    """The prompt as chat messages (what a multi-turn rollout starts the conversation from)."""
    chat = data.chats[row] if data.chats is not None else None
    if chat is not None:
        return [dict(m) for m in chat]
    prompt = data.prompts[row]
    return [dict(m) for m in prompt] if not isinstance(prompt, str) else [{"role": "user", "content": prompt}]


class PromptLoader:
    """Batches of ``batch_size`` prompts, reshuffled each epoch from ``seed``; ``state_dict`` resumes exactly.

    ``dataset`` may come encoded (``encode_prompts``, as ``hybridflow train``
    does before launch); otherwise it is encoded here with ``prompt_format``.
    A prompt over ``max_prompt_length`` tokens is an error here (filter
    before, ``drop_or_refuse_overlong``, to drop them instead);
    ``max_prompt_length`` None leaves long prompts to the rollout (its
    ``truncation: left``).
    """

    def __init__(self, dataset: PromptDataset, tokenizer, batch_size: int, max_prompt_length: int | None,
                 shuffle: bool = True, seed: int = 0, prompt_format: PromptFormat | None = None,
                 images: ImageProcessing | None = None) -> None:
        if batch_size > len(dataset):
            raise ValueError(f"batch_size {batch_size} is larger than the dataset ({len(dataset)} prompts)")
        dataset = encode_prompts(dataset, tokenizer, prompt_format or PromptFormat(), images=images)
        self.images = images if dataset.images is not None else None
        if max_prompt_length is not None:
            dataset = drop_or_refuse_overlong(dataset, max_prompt_length, filter_overlong=False)
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.batch_size, self.max_prompt_length = batch_size, max_prompt_length
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> DataProto:
        """The next ``batch_size`` prompts (an epoch's remainder smaller than a batch is skipped)."""
        if self.position + self.batch_size > len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        index = self._order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return self.batch(index)

    def batch(self, index: list[int]) -> DataProto:
        data = self.dataset
        rows = [data.input_ids[i] for i in index]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for row, tokens in enumerate(rows):
            ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens):] = 1
        fields = {"ground_truth": [data.answers[i] for i in index], "uid": [f"p{i}" for i in index],
                  "prompt_text": [data.prompt_texts[i] for i in index],
                  "messages": [prompt_messages(data, i) for i in index],
                  "data_source": [data.data_sources[i] for i in index],
                  "extra_info": [data.extra_infos[i] for i in index]}
        if self.images is not None:  # the images for the rollout engine, and the vision tower's inputs
            fields[MULTI_MODAL_DATA] = [{"image": list(data.images[i])} if data.images[i] else None for i in index]
            fields[MULTI_MODAL_INPUTS] = [self.images.inputs(data.images[i]) if data.images[i] else None
                                          for i in index]
        return DataProto({"input_ids": ids, "attention_mask": mask}, fields)

    def all_batches(self) -> list[DataProto]:
        """Every prompt once, in order (validation)."""
        n = len(self.dataset)
        return [self.batch(list(range(s, min(s + self.batch_size, n)))) for s in range(0, n, self.batch_size)]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
