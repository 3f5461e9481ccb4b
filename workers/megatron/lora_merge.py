"""Whole LoRA adapters merged into a generation shard: ``W_base + scaling x B A``, cut as the generation layout
cuts the weight.

Each adapted linear of the shard takes its adapters cut for the generation TP rank (``cut_adapter``), laid out
as the linear's weight shard lays out its parts (the fused QKV's rows interleaved over the rank's query
groups, fc1's [gate; up]: ``fused_delta``). The merge is the one PEFT's ``merge_and_unload`` computes, on the
rank's rows or columns. The colocated sync (``HybridBridge``) and the cross-pool one (``CrossPoolSync``) both
merge here, after the adapters arrived whole as their group's pieces (``hybridengine.reshard.adapter_group``).
"""

from __future__ import annotations

import torch

from hybridengine.model.catalogue import layer_index, projections
from hybridengine.reshard.plan import GenerationLayout
from workers.megatron.lora import cut_adapter, fused_delta

__all__ = ["merge_into"]


def merge_into(base: dict[str, torch.Tensor], adapters: dict, spec, gen: GenerationLayout, gen_tp_rank: int,
               gen_pp_rank: int, scaling: float, out: dict[str, torch.Tensor]) -> None:
    """``out[name] = base[name] + scaling x B A`` for every adapted linear of a generation shard (``base``, names
    local to generation stage ``gen_pp_rank``), the whole ``adapters`` ((layer, linear, part) -> (A, B)) cut for
    generation TP rank ``gen_tp_rank``; ``out``'s tensors are made at the first call and refilled after."""
    layers = spec.layers_of_stage(gen_pp_rank, gen.pipeline_parallel)
    groups = max(spec.num_query_groups // gen.tensor_parallel, 1)
    row_parallel = {p.linear: p.row_parallel for p in projections(spec).values()}
    by_linear: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, linear, part), (a, b) in adapters.items():
        if layer in layers:
            by_linear.setdefault((layer, linear), {})[part] = cut_adapter(row_parallel[linear], a, b,
                                                                          gen.tensor_parallel, gen_tp_rank)
    with torch.no_grad():
        for name, tensor in base.items():
            if not name.endswith(".weight") or ".layers." not in name:
                continue
            linear = name.removesuffix(".weight").split(".layers.", 1)[1].split(".", 1)[1]
            parts = by_linear.get((layers[layer_index(name)], linear))
            if parts is None:
                continue
            if name not in out:
                out[name] = torch.empty_like(tensor)
            delta = fused_delta(linear, parts, scaling, groups)
            torch.add(tensor, delta.to(tensor.device, tensor.dtype), out=out[name])
