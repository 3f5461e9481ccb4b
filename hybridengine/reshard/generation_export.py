"""Full Hugging Face tensors from generation shards: each generation TP group gathers its shards.

For exporting what the generation engine runs (or handing a consumer that
wants unsharded weights), per generation pipeline stage. Every rank of the
world must call it: building the generation TP groups is collective.
"""

from __future__ import annotations

import torch

from hybridengine.model.hf_mapping import hf_source, merge_shards
from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.plan import ReshardPlan
from hybridengine.model.catalogue import stage_params
from hybridengine.reshard.transport import Transport

__all__ = ["generation_to_hf"]


def generation_to_hf(
    spec: ModelSpec, plan: ReshardPlan, rank: int, weights: dict[str, torch.Tensor], transport: Transport
) -> dict[str, torch.Tensor]:
    """HF-named full tensors of ``rank``'s generation stage."""
    gen, me = plan.gen, plan.ranks[rank]
    keys = {group: transport.new_group(group) for group in plan.gen_tp_groups}
    my_group = next(g for g in plan.gen_tp_groups if rank in g)
    out: dict[str, torch.Tensor] = {}
    for param in stage_params(spec, gen.tensor_parallel, gen.pipeline_parallel, me.gen_pp_rank):
        if param.name == "output_layer.weight" and spec.tie_word_embeddings and not spec.is_value_model:
            continue  # HF keeps one tied tensor, the embedding
        local = weights[param.name]
        if param.geometry.replicated or gen.tensor_parallel == 1:
            shards = [local]
        else:
            parts = transport.all_gather(local.contiguous().reshape(-1), keys[my_group])
            shards = [p.view(param.shape) for p in parts]
        source = hf_source(param.name, spec, me.gen_pp_rank, gen.pipeline_parallel)
        out.update(merge_shards(source, shards, spec))
    return out
