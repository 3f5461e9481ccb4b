"""RewardModel: a learned scalar reward (or cost) on the megatron engine's value head.

It loads a Hugging Face ``*ForSequenceClassification`` checkpoint with one
label at any TP/PP, holds no optimizer, and scores each sequence with the
head's output at its last valid token, which is where HF's sequence
classification pools. The same class serves as the Safe-RLHF cost model
beside the reward model: give it ``score_key="cost_scores"``.
"""

from __future__ import annotations

import torch

from hybridengine.model_spec import ModelSpec
from workers.data_proto import DataProto
from workers.dispatch import Dispatch
from workers.megatron.config import EngineConfig
from workers.megatron.micro_batches import MicroBatch
from workers.megatron.engine_role import EngineRole
from workers.register import register
from workers.reward.rule_reward import last_token_scores

__all__ = ["RewardModel", "sequence_scores"]


def sequence_scores(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """The head's output at each row's last valid token, [B] fp32.

    The engine rolled every row so that its valid tokens start at index 0,
    so the last one sits at index (number of valid tokens - 1).
    """
    last = mb["attention_mask"].long().sum(-1).sub(1).clamp(min=0)
    return output[..., 0].float().gather(1, last.unsqueeze(1)).squeeze(1)


class RewardModel(EngineRole):
    """Sequence-level scores from a one-label value-head model, placed on the last response token."""

    def __init__(
        self, model_path: str, engine: EngineConfig | dict | None = None, score_key: str = "rm_scores"
    ) -> None:
        if not isinstance(score_key, str) or not score_key or score_key == "token_level_scores":
            raise ValueError(f"score_key must be a non-empty name other than 'token_level_scores', got {score_key!r}")
        spec = ModelSpec.from_pretrained(model_path)  # cheap: the config only, before megatron starts
        if spec.is_value_model and spec.num_labels != 1:
            raise ValueError(
                f"RewardModel needs a checkpoint with num_labels=1 (one scalar score); {model_path} has {spec.num_labels}"
            )
        self.score_key = score_key
        self._build_engine(model_path, engine, optim=None, value_model=True)

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto | None:
        """``<score_key>`` [B] and ``token_level_scores`` [B, R]; None on ranks that do not answer."""
        def step(mb: MicroBatch, output: torch.Tensor):
            return torch.zeros(()), {"scores": sequence_scores(mb, output)}

        outputs = self.engine.run(data, step, forward_only=True)
        if not outputs:
            return None
        scores = outputs.rows("scores")
        token_level = last_token_scores(scores, data.batch["response_mask"])
        return DataProto({"token_level_scores": token_level, self.score_key: scores})
