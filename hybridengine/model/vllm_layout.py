"""Generation shards in vLLM's per-rank layout (Llama / Qwen2 / Qwen3 models in vLLM).

vLLM keeps, per TP rank, ``qkv_proj`` as [q; k; v] (all of the rank's query
heads, then its key heads, then its value heads) and ``gate_up_proj`` as
[gate; up]. A megatron TP shard holds the same rows in a different order for
QKV (group-major: per query group its query heads, key head, value head) and
already in vLLM's order for fc1. Names come from the parameter catalogue
(vLLM's checkpoint names with the layer index made global). Embedding and
output-layer shards keep only the rows of the real vocabulary: megatron's
padding rows are not vLLM's (see ``workers.rollout.vocab_rows``).
"""

from __future__ import annotations

import torch

from hybridengine.model.spec import ModelSpec
from hybridengine.ops.copy_blocks import copy_blocks, whole_block
from hybridengine.model.catalogue import ShardKind, stage_params

__all__ = ["qkv_group_major_to_vllm", "to_vllm_shard"]


def qkv_group_major_to_vllm(tensor: torch.Tensor, spec: ModelSpec, tp: int) -> torch.Tensor:
    """A megatron QKV shard (weight or bias) reordered to vLLM's [q; k; v] for the same TP rank, in one pass."""
    groups = spec.num_query_groups // tp
    per_group = spec.num_attention_heads // spec.num_query_groups
    row = spec.head_dim * (tensor[0].numel() if tensor.dim() > 1 else 1)  # elements per head
    q_size, group_size = per_group * row, (per_group + 2) * row
    k_start, v_start = groups * q_size, groups * (q_size + row)
    blocks = []
    for g in range(groups):
        src = g * group_size
        blocks.append(whole_block(0, src, g * q_size, q_size))
        blocks.append(whole_block(0, src + q_size, k_start + g * row, row))
        blocks.append(whole_block(0, src + q_size + row, v_start + g * row, row))
    return copy_blocks(torch.empty_like(tensor, memory_format=torch.contiguous_format), [tensor.contiguous()], blocks)


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
        tensor = weights[param.name]
        if param.kind == ShardKind.QKV:
            tensor = qkv_group_major_to_vllm(tensor, spec, tp)
        elif param.kind == ShardKind.VOCAB_ROWS:
            start, end = spec.real_vocab_rows(tp, tp_rank)
            tensor = tensor[: end - start]
        out[param.vllm_name] = tensor
    return out
