"""Checks of a training setup that need no process: run them before any group forms."""

from __future__ import annotations

import importlib.util

from hybridengine.parallel.layout import ParallelLayout
from workers.megatron.config import EngineConfig
from workers.megatron.hf_checkpoint import HFCheckpointReader
from hybridengine.model.spec import ModelSpec

__all__ = ["check_sequence_layout", "check_training_setup", "mini_batch_plan"]


def check_sequence_layout(spec: ModelSpec | None, engine: EngineConfig) -> None:
    """Refuse, naming the setting, what context parallelism and packed sequences do not take yet (``spec``: the
    model; None: not read yet), and the transformer-engine attention where transformer-engine is not installed."""
    if engine.attention == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        raise ValueError("attention 'transformer_engine': transformer-engine is not installed here (it needs a GPU "
                         "and its CUDA build); use attention 'local', the engine's own (CPU and GPU)")
    if not engine.packed or spec is None:
        return
    asked = (f"context_parallel {engine.context_parallel}" if engine.context_parallel > 1
             else "pack_sequences true")
    if spec.is_moe:
        raise ValueError(f"{asked}: {spec.architecture} is a mixture of experts, whose routing replay and padding "
                         "masks work on padded rows; context parallelism and packed sequences take dense models for "
                         "now (set context_parallel 1 and pack_sequences false)")
    if spec.vision is not None:
        raise ValueError(f"{asked}: {spec.architecture} is a vision-language model, whose multimodal positions are "
                         "laid out per padded row; set context_parallel 1 and pack_sequences false")


def mini_batch_plan(batch_size: int, mini_batch_size: int, dp: int, micro_batch_size: int) -> int:
    """Sequences per DP rank in one mini-batch; raises unless everything divides."""
    if batch_size % mini_batch_size != 0:
        raise ValueError(f"batch of {batch_size} sequences does not divide into PPO mini-batches of {mini_batch_size}")
    if mini_batch_size % dp != 0:
        raise ValueError(f"ppo_mini_batch_size {mini_batch_size} does not divide over {dp} data-parallel ranks")
    per_rank = mini_batch_size // dp
    if per_rank % micro_batch_size != 0:
        raise ValueError(
            f"a mini-batch gives each DP rank {per_rank} sequences, not a multiple of micro_batch_size {micro_batch_size}"
        )
    return per_rank


def check_training_setup(
    model_path: str,
    engine: EngineConfig,
    world_size: int,
    batch_size: int | None = None,
    mini_batch_size: int | None = None,
) -> tuple[ModelSpec, ParallelLayout, HFCheckpointReader]:
    """Raise one clear error for the first thing that cannot work; else return what was read.

    The returned spec has the vocabulary padded for the engine's TP size
    (``make_vocab_size_divisible_by``). Covers: an unsupported or unreadable
    config.json, TP that does not divide heads / KV groups / FFN, PP that does not divide the layers, a
    world size other than TP*PP*DP, EP that does not divide the experts or EP x ETP a stage's ranks, missing or truncated safetensors files,
    and batch sizes that do not split into mini- and micro-batches.
    """
    spec = ModelSpec.from_pretrained(model_path).with_padded_vocab(
        engine.make_vocab_size_divisible_by, engine.tensor_parallel
    )
    spec.check_layout(engine.tensor_parallel, engine.pipeline_parallel, engine.expert_parallel,
                      engine.expert_tensor_parallel)
    layout = engine.layout(world_size)
    check_sequence_layout(spec, engine)
    reader = HFCheckpointReader(model_path)
    if batch_size is not None:
        mini_batch_plan(batch_size, mini_batch_size or batch_size, layout.data_replicas, engine.micro_batch_multiple)
    return spec, layout, reader
