"""RewardModel: a learned scalar reward (or cost) on the megatron engine's value head.

It loads a Hugging Face ``*ForSequenceClassification`` checkpoint with one
label at any TP/PP, holds no optimizer, and scores each sequence with the
head's output at its last valid token, which is where HF's sequence
classification pools. The same class serves as the Safe-RLHF cost model
beside the reward model: give it ``score_key="cost_scores"``.

``RewardModel.from_pretrained`` routes: a checkpoint the megatron engine can
hold (``ModelSpec.from_pretrained`` reads its config) gets this worker; any
other one-label sequence classifier (DeBERTa, BERT-style, ...) gets the
data-parallel ``HFRewardModel`` (``workers.reward.hf_reward_model``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hybridengine.model.spec import ModelConfigError, ModelSpec
from workers.data_proto import DataProto
from workers.dispatch import Dispatch
from workers.megatron.config import EngineConfig
from workers.megatron.micro_batches import MicroBatch
from workers.megatron.engine_role import EngineRole
from workers.pretrained import resolve_pretrained
from workers.register import register
from workers.reward.hf_reward_model import HFRewardModel, check_reward_checkpoint, check_reward_options, same_vocabulary
from workers.reward.rule_reward import last_token_scores
from workers.role_spec import RoleSpec

__all__ = ["FROM_PRETRAINED_KEYWORDS", "RewardModel", "megatron_spec_or_none", "sequence_scores"]

# Every keyword RewardModel.from_pretrained takes; each path reads the ones that mean something to it.
FROM_PRETRAINED_KEYWORDS = ("device_map", "engine", "max_length", "micro_batch_size", "pipeline_parallel", "precision",
                            "score_key", "tensor_parallel", "tokenizer_path")
HF_DEFAULT_MICRO_BATCH_SIZE = 8


def megatron_spec_or_none(model_path: str) -> ModelSpec | None:
    """The engine's ModelSpec of ``model_path`` (config.json only, no weights), or None where the megatron
    engine cannot hold that model (another architecture, activation or RoPE; or no config.json there)."""
    try:
        return ModelSpec.from_pretrained(model_path)
    except ModelConfigError:
        return None


def _engine_dict(engine: Any) -> dict:
    if engine is None:
        return {}
    if isinstance(engine, EngineConfig):
        return dataclasses.asdict(engine)
    if isinstance(engine, dict):
        return dict(engine)
    raise TypeError(f"engine must be a dict of EngineConfig fields or an EngineConfig, got {type(engine).__name__}")


def _reads_policy_ids(model_path: str, tokenizer_path: str | None) -> bool:
    """Whether a megatron reward model can score the policy's ids as they are: no policy tokenizer named,
    the checkpoint has no tokenizer to compare, or both tokenizers have one vocabulary."""
    if tokenizer_path is None:
        return True
    from transformers import AutoTokenizer

    try:
        own = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError):
        return True
    return same_vocabulary(own, AutoTokenizer.from_pretrained(tokenizer_path))


def sequence_scores(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """The head's output at each row's last valid token, [B] fp32.

    The engine rolled every row so that its valid tokens start at index 0,
    so the last one sits at index (number of valid tokens - 1).
    """
    last = mb["attention_mask"].long().sum(-1).sub(1).clamp(min=0)
    return output[..., 0].float().gather(1, last.unsqueeze(1)).squeeze(1)


class RewardModel(EngineRole):
    """Sequence-level scores from a one-label value-head model, placed on the last response token."""

    @classmethod
    def from_pretrained(cls, model_path: str, **kwargs: Any) -> RoleSpec:
        """A reward-model role on any one-label sequence-classification checkpoint; nothing loads yet.

        Routing, decided from config files only: where the megatron engine can hold the model
        (``megatron_spec_or_none``) and it reads the policy's ids (``tokenizer_path`` None, or the same
        vocabulary), the spec is ``RewardModel``'s exactly as ``EngineRole.from_pretrained`` makes it;
        every other checkpoint gets ``HFRewardModel`` (data-parallel, its own tokenizer), with
        ``tensor_parallel`` / ``pipeline_parallel`` dropped (each rank holds the whole model), ``precision``
        and ``micro_batch_size`` taken from the keywords or else ``engine`` (else bf16 and 8), and
        ``device_map`` ignored. Keywords: ``FROM_PRETRAINED_KEYWORDS``; any other one, a bad value, or a
        checkpoint without exactly one label raises here, before any worker starts.
        """
        model_path = resolve_pretrained(model_path, missing_ok=True)  # a hub id: its cached snapshot, found now
        unknown = sorted(set(kwargs) - set(FROM_PRETRAINED_KEYWORDS))
        if unknown:
            raise TypeError(f"RewardModel.from_pretrained got unknown keyword(s) {unknown}; valid keywords: "
                            f"{list(FROM_PRETRAINED_KEYWORDS)}")
        device_map = kwargs.pop("device_map", None)
        if device_map not in (None, "auto"):
            raise ValueError(f"device_map {device_map!r} is not supported; valid: 'auto' or None")
        engine = _engine_dict(kwargs.pop("engine", None))
        precision = kwargs.pop("precision", None)
        if precision is not None:
            if engine.get("precision", precision) != precision:
                raise ValueError(f"precision={precision!r} and engine precision {engine['precision']!r} disagree; "
                                 f"set one of them")
            engine["precision"] = precision
        tokenizer_path, max_length = kwargs.pop("tokenizer_path", None), kwargs.pop("max_length", None)

        spec = megatron_spec_or_none(model_path)
        if spec is not None and _reads_policy_ids(model_path, tokenizer_path):
            if max_length is not None:
                raise ValueError(f"max_length applies to HFRewardModel only; {model_path} runs on the megatron engine, "
                                 f"which scores the policy's ids as they are")
            if not spec.is_value_model:
                raise ValueError(f"RewardModel needs a sequence-classification checkpoint with a value head; "
                                 f"{model_path} is a {spec.architecture}")
            if spec.num_labels != 1:
                raise ValueError(f"RewardModel needs a checkpoint with num_labels=1 (one scalar score); {model_path} "
                                 f"has num_labels={spec.num_labels}")
            if "score_key" in kwargs:
                check_reward_options(score_key=kwargs["score_key"])
            EngineConfig(**{**engine, **{k: kwargs[k] for k in ("tensor_parallel", "pipeline_parallel",
                                                                "micro_batch_size") if k in kwargs}})  # checked now
            explicit = "tensor_parallel" in kwargs or "pipeline_parallel" in kwargs
            role = super().from_pretrained(model_path, engine=engine or None, **kwargs)
            return dataclasses.replace(role, device_map=device_map, explicit_parallelism=explicit) if device_map else role

        config = EngineConfig(**engine)  # the same checks the megatron path would make of it
        micro_batch_size = kwargs.get("micro_batch_size",
                                      engine.get("micro_batch_size", HF_DEFAULT_MICRO_BATCH_SIZE))
        hf_kwargs = {"model_path": model_path, "tokenizer_path": tokenizer_path, "precision": config.precision,
                     "micro_batch_size": micro_batch_size, "score_key": kwargs.get("score_key", "rm_scores"),
                     "max_length": max_length}
        check_reward_options(hf_kwargs["precision"], micro_batch_size, hf_kwargs["score_key"], max_length)
        check_reward_checkpoint(model_path)
        return RoleSpec(HFRewardModel, hf_kwargs)

    def __init__(
        self, model_path: str, engine: EngineConfig | None = None, score_key: str = "rm_scores"
    ) -> None:
        if not isinstance(score_key, str) or not score_key or score_key == "token_level_scores":
            raise ValueError(f"score_key must be a non-empty name other than 'token_level_scores', got {score_key!r}")
        spec = ModelSpec.from_pretrained(model_path)  # cheap: the config only, before megatron starts
        if spec.is_value_model and spec.num_labels != 1:
            raise ValueError(
                f"RewardModel needs a checkpoint with num_labels=1 (one scalar score); {model_path} has {spec.num_labels}"
            )
        if engine is not None and engine.packed:
            raise ValueError(f"a reward model reads each row's last token from padded rows: its engine takes neither "
                             f"context_parallel ({engine.context_parallel}) nor pack_sequences "
                             f"({engine.pack_sequences}) yet; its sequences are scored whole, forward only")
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
