"""Generation shards in vLLM's per-rank layout (Llama / Qwen2 / Qwen3 models in vLLM).

vLLM keeps each fused tensor part-major per TP rank: ``qkv_proj`` as
[q; k; v] (all of the rank's query heads, then its key heads, then its value
heads) and ``gate_up_proj`` as [gate; up]. A megatron shard holds the same
rows group-major for QKV and already part-major for fc1, so only QKV moves
(``ShardGeometry.stacked``). Names come from the parameter catalogue (vLLM's
checkpoint names with the layer index made global). Embedding and
output-layer shards keep only the rows of the real vocabulary: megatron's
padding rows are not vLLM's (see ``workers.rollout.vocab_rows``).
"""

from __future__ import annotations

import torch

from hybridengine.model.catalogue import stage_params
from hybridengine.model.spec import ModelSpec

__all__ = ["to_vllm_shard"]


def to_vllm_shard(
    spec: ModelSpec, weights: dict[str, torch.Tensor], tp: int, pp: int, pp_rank: int, tp_rank: int = 0
) -> dict[str, torch.Tensor]:
    """A generation shard (megatron names local to its stage) under vLLM's names and per-rank layout.

    Everything but QKV stays a view of the generation buffer. Vocabulary
    shards of TP rank ``tp_rank`` are cut to their rows of the real
    vocabulary (none of megatron's padding rows).
    """
    out = {}
    for param in stage_params(spec, tp, pp, pp_rank):
        if param.vllm_name is None:
            raise ValueError(f"{param.name} of a {spec.architecture} has no vLLM counterpart (a value head cannot generate)")
        out[param.vllm_name] = param.geometry.stacked(weights[param.name], tp_rank)
    return out
