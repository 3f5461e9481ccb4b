"""Each step's samples as JSON lines (``trainer.rollout_data_dir``, verl's name): what the model saw and
said, its score, and per response token the mask, reward, return and advantage the update trained on (and in an
async run the policy version that sampled each token).

One file per step, ``{dir}/{step}.jsonl``, one line per sample; it is written whole and then renamed, so
a reader never sees half a step. The per-token lists cover the response tokens up to the last non-padding
position: in a multi-turn rollout the observation tokens between the turns are there with mask 0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from workers.data_proto import DataProto

__all__ = ["PER_TOKEN_FIELDS", "RolloutDump"]

#: The per-response-token tensors a dump line carries, where the batch has them.
PER_TOKEN_FIELDS = ("response_mask", "token_level_rewards", "returns", "advantages", "values", "old_log_probs")


def _rounded(values: torch.Tensor) -> list[float]:
    return [round(float(v), 6) for v in values.tolist()]


class RolloutDump:
    """Writes a step's batch under ``directory``; ``tokenizer_path``: decode prompts and responses to text."""

    def __init__(self, directory: str | Path, tokenizer_path: str | None = None) -> None:
        self.directory = Path(directory)
        self.tokenizer_path = tokenizer_path
        self._tokenizer: Any = None

    def _decode(self, ids: list[int]) -> str | None:
        if self.tokenizer_path is None:
            return None
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def lines(self, step: int, batch: DataProto) -> list[dict[str, Any]]:
        b = batch.batch
        prompt_width = b["prompts"].shape[1]
        attention = b["attention_mask"]
        lines = []
        for row in range(len(batch)):
            prompt_ids = b["prompts"][row][attention[row, :prompt_width].bool()].tolist()
            response_attention = attention[row, prompt_width:]
            length = int(response_attention.nonzero().max()) + 1 if response_attention.any() else 0
            response_ids = b["responses"][row, :length].tolist()
            line: dict[str, Any] = {"step": step, "prompt": self._decode(prompt_ids),
                                    "response": self._decode(response_ids), "score": float(b["scores"][row]),
                                    "prompt_ids": prompt_ids, "response_ids": response_ids}
            for key in ("uid", "data_source"):
                if key in batch.non_tensor_batch:
                    line[key] = str(batch.non_tensor_batch[key][row])
            for key in PER_TOKEN_FIELDS:
                if key in b:
                    line[key] = _rounded(b[key][row, :length])
            if "token_versions" in b:  # async runs: the policy version that sampled each token (-1: none did)
                line["token_versions"] = b["token_versions"][row, :length].tolist()
                line["policy_version"] = int(b["policy_version"][row])
            lines.append(line)
        return lines

    def write(self, step: int, batch: DataProto) -> Path:
        """``{directory}/{step}.jsonl``, replaced whole."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{step}.jsonl"
        partial = path.with_suffix(".jsonl.partial")
        with partial.open("w") as out:
            for line in self.lines(step, batch):
                out.write(json.dumps(line) + "\n")
        os.replace(partial, path)
        return path
