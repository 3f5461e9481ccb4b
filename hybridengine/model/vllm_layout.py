"""Generation shards in vLLM's per-rank layout (Llama / Qwen2 / Qwen3 models in vLLM).

vLLM keeps each fused tensor part-major per TP rank: ``qkv_proj`` as
[q; k; v] (all of the rank's query heads, then its key heads, then its value
heads) and ``gate_up_proj`` as [gate; up]. A megatron shard holds the same
rows group-major for QKV and already part-major for fc1, so only QKV moves
(``ShardGeometry.stacked``). Names come from the parameter catalogue (vLLM's
checkpoint names with the layer index made global). Embedding and
output-layer shards keep only the rows of the real vocabulary: megatron's
padding rows are not vLLM's (see ``workers.rollout.vocab_rows``). A mixture
of experts' routed experts go into vLLM's fused-experts tensors, one pair per
layer.
"""

from __future__ import annotations

import torch

from hybridengine.model.catalogue import ExpertShard, stage_params
from hybridengine.model.spec import ModelSpec
from hybridengine.model.vision_catalogue import to_vllm_vision

__all__ = ["to_vllm_shard"]


def to_vllm_shard(
    spec: ModelSpec, weights: dict[str, torch.Tensor], tp: int, pp: int, pp_rank: int, tp_rank: int = 0,
    expert_parallel: bool = False, partial: bool = False,
) -> dict[str, torch.Tensor]:
    """A generation shard (megatron names local to its stage) under vLLM's names and per-rank layout.

    Everything but QKV and a mixture of experts' routed experts stays a view of the generation buffer.
    Vocabulary shards of TP rank ``tp_rank`` are cut to their rows of the real vocabulary (none of megatron's
    padding rows). Routed experts (whole on each rank under ``expert_parallel``, else cut across TP) are
    stacked as vLLM's fused-experts layer holds them: ``w13_weight`` [experts, 2 x FFN, hidden] ([gate; up] per
    expert, megatron's fc1 as is) and ``w2_weight`` [experts, hidden, FFN], in the rank's expert order.
    """
    experts = None
    if spec.moe is not None:
        experts = ExpertShard(tp, tp_rank, 1) if expert_parallel else ExpertShard(1, 0, tp)
    out, stacks = {}, {}
    for param in stage_params(spec, tp, pp, pp_rank, experts=experts):
        if partial and param.name not in weights:
            continue
        if param.expert is not None:
            fused = "w13_weight" if param.name.endswith("linear_fc1.weight") else "w2_weight"
            stacks.setdefault(f"model.layers.{param.layer}.mlp.experts.{fused}", []).append(weights[param.name])
            continue
        if param.vllm_name is None:
            raise ValueError(f"{param.name} of a {spec.architecture} has no vLLM counterpart (a value head cannot generate)")
        out[param.vllm_name] = param.geometry.stacked(weights[param.name], tp_rank)
    out.update({name: torch.stack(tensors) for name, tensors in stacks.items()})
    if spec.vision is not None and pp_rank == 0:  # the vision tower, whole on every generation rank
        out.update(to_vllm_vision(weights, spec))
    return out
