"""Prompts for training and validation, and a dataloader that can resume mid-epoch.

Two sources: the built-in arithmetic task (``a+b=`` / ``a-b=`` / ``a*b=``
with the answer as ground truth, generated from a seed, nothing to
download), and JSONL files with a prompt and a ground-truth field per line.
Batches are DataProtos of left-padded ``input_ids`` / ``attention_mask``
with ``ground_truth`` and a ``uid`` per prompt (the group id of its n samples).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.data_proto import DataProto

__all__ = ["PromptDataset", "PromptLoader", "arithmetic_prompts", "load_jsonl_prompts"]


@dataclass(frozen=True)
class PromptDataset:
    prompts: tuple[str, ...]
    answers: tuple[str | None, ...]

    def __len__(self) -> int:
        return len(self.prompts)


def arithmetic_prompts(count: int, seed: int, max_operand: int = 9) -> PromptDataset:
    """``count`` problems like ``7+5=`` (answers ``12``); the same seed gives the same problems."""
    if count < 1 or max_operand < 1:
        raise ValueError(f"need count >= 1 and max_operand >= 1, got count={count}, max_operand={max_operand}")
    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(count):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice("+-*")
        prompts.append(f"{a}{op}{b}=")
        answers.append(str(a + b if op == "+" else a - b if op == "-" else a * b))
    return PromptDataset(tuple(prompts), tuple(answers))


def load_jsonl_prompts(path: str | Path, prompt_key: str = "prompt", answer_key: str = "ground_truth") -> PromptDataset:
    """One JSON object per line with ``prompt_key`` (and optionally ``answer_key``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    prompts, answers = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number} is not valid JSON: {exc}") from None
        if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
            raise ValueError(f"{path}:{number} has no string field {prompt_key!r}; fields: "
                             f"{sorted(row) if isinstance(row, dict) else type(row).__name__}")
        prompts.append(row[prompt_key])
        answer = row.get(answer_key)
        answers.append(None if answer is None else str(answer))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return PromptDataset(tuple(prompts), tuple(answers))


class PromptLoader:
    """Batches of ``batch_size`` prompts, reshuffled each epoch from ``seed``; ``state_dict`` resumes exactly."""

    def __init__(self, dataset: PromptDataset, tokenizer, batch_size: int, max_prompt_length: int,
                 shuffle: bool = True, seed: int = 0) -> None:
        if batch_size > len(dataset):
            raise ValueError(f"batch_size {batch_size} is larger than the dataset ({len(dataset)} prompts)")
        self.dataset, self.tokenizer = dataset, tokenizer
        self.batch_size, self.max_prompt_length = batch_size, max_prompt_length
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.position = 0, 0
        self._encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in dataset.prompts]

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
        rows = [self._encoded[i] for i in index]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for row, tokens in enumerate(rows):
            ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens):] = 1
        return DataProto(
            {"input_ids": ids, "attention_mask": mask},
            {"ground_truth": [self.dataset.answers[i] for i in index], "uid": [f"p{i}" for i in index],
             "prompt_text": [self.dataset.prompts[i] for i in index]},
        )

    def all_batches(self) -> list[DataProto]:
        """Every prompt once, in order (validation)."""
        n = len(self.dataset)
        return [self.batch(list(range(s, min(s + self.batch_size, n)))) for s in range(0, n, self.batch_size)]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
