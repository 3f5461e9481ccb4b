"""A LoRA actor's generation weights: the frozen base resharded once, the adapters merged in every step.

The base never changes, so its generation shard is built once per generation layout through the
3D-HybridEngine and kept (at the training layout itself, it is the training shards: no copy). Each sync then moves only the adapters: every rank gathers them whole (over TP,
then over the pipeline stages) and merges its generation shard of each adapted linear,
``W_base + scaling x B A`` cut as the generation layout cuts the weight (the fused QKV's rows interleaved over
the generation rank's query groups, fc1's as [gate; up]), into a buffer kept for the next step. The merge is
the one PEFT's ``merge_and_unload`` computes, on the rank's rows or columns.

What crosses the link after the first step is the adapters' bytes (``reshard/lora_bytes_received``), not the
model's. The generation shard stays allocated between steps (the training shards are not released).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridengine.model.catalogue import layer_index
from hybridengine.reshard.plan import GenerationLayout
from hybridengine.reshard.resharder import Resharder
from hybridengine.reshard.weight_plan import WeightPlan
from workers.megatron.lora import LORA_TARGETS, cut_adapter, full_shapes, fused_delta, whole_adapters

__all__ = ["LoRAGenerationWeights", "adapter_layout", "flatten_adapters", "merge_into", "unflatten_adapters"]


def adapter_layout(spec, rank: int, targets: tuple[str, ...]) -> list[tuple[tuple[int, str, str], tuple, tuple]]:
    """Every whole adapter of the model in one fixed order, (layer, linear, part) with A's and B's shapes: how a
    flat message of them is laid out (``flatten_adapters``), the same on both sides of a link."""
    shapes = full_shapes(spec)
    out = []
    for layer in range(spec.num_layers):
        for target in LORA_TARGETS:
            if target in targets:
                linear, part = LORA_TARGETS[target]
                fan_in, fan_out = shapes[part]
                out.append(((layer, linear, part), (rank, fan_in), (fan_out, rank)))
    return out


def flatten_adapters(adapters: dict, layout: list) -> torch.Tensor:
    """Whole adapters by (layer, linear, part) -> (A, B) as one flat tensor, in ``layout``'s order."""
    return torch.cat([t.reshape(-1) for key, _, _ in layout for t in adapters[key]])


def unflatten_adapters(flat: torch.Tensor, layout: list) -> dict:
    """``flatten_adapters``' inverse: views of ``flat``."""
    out, offset = {}, 0
    for key, a_shape, b_shape in layout:
        a_numel, b_numel = a_shape[0] * a_shape[1], b_shape[0] * b_shape[1]
        out[key] = (flat[offset: offset + a_numel].view(a_shape),
                    flat[offset + a_numel: offset + a_numel + b_numel].view(b_shape))
        offset += a_numel + b_numel
    return out


def merge_into(base: dict[str, torch.Tensor], adapters: dict, spec, gen: GenerationLayout, gen_tp_rank: int,
               gen_pp_rank: int, scaling: float, out: dict[str, torch.Tensor]) -> None:
    """``out[name] = base[name] + scaling x B A`` for every adapted linear of a generation shard (``base``, names
    local to generation stage ``gen_pp_rank``), the whole ``adapters`` ((layer, linear, part) -> (A, B)) cut for
    generation TP rank ``gen_tp_rank``; ``out``'s tensors are made at the first call and refilled after."""
    layers = spec.layers_of_stage(gen_pp_rank, gen.pipeline_parallel)
    groups = max(spec.num_query_groups // gen.tensor_parallel, 1)
    by_linear: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, linear, part), (a, b) in adapters.items():
        if layer in layers:
            by_linear.setdefault((layer, linear), {})[part] = cut_adapter(linear, part, a, b, gen.tensor_parallel,
                                                                          gen_tp_rank)
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


class LoRAGenerationWeights:
    """The generation shards of one LoRA engine (``MegatronEngine`` with adapters), per generation layout."""

    def __init__(self, engine, transport, bucket_bytes: int | None = None) -> None:
        self.engine, self.transport, self.bucket_bytes = engine, transport, bucket_bytes
        self.base: dict[GenerationLayout, dict[str, torch.Tensor]] = {}
        self.merged: dict[GenerationLayout, dict[str, torch.Tensor]] = {}
        # the last sync's adapters whole, (layer, linear, part) -> (A, B), when they were not merged
        self.whole: dict[tuple[int, str, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def build(self, weights: WeightPlan, params: dict[str, torch.Tensor], merge: bool = True
              ) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's generation shard with the current adapters merged (``merge`` False: the base alone, the
        adapters whole in ``self.whole``, for an engine that serves them), and the move's bytes; collective."""
        rank = dist.get_rank()
        gen = weights.gen
        base_bytes = 0
        if gen not in self.base:  # the frozen base, once: the micro-DP gather, the training shards kept
            before = self.transport.bytes_received
            dense = {p.name: params[p.name] for p in weights.training_params(rank)}
            layout = self.engine.layout
            if (gen.tensor_parallel, gen.pipeline_parallel) == (layout.tp, layout.pp):
                self.base[gen] = dense  # the training shards are the generation shards: no copy
            else:
                self.base[gen] = Resharder(weights, rank, dense, self.transport, self.bucket_bytes).to_generation()
            base_bytes = self.transport.bytes_received - before
        adapters, lora_bytes = self.gather_adapters()
        if not merge:
            self.whole = adapters
            return dict(self.base[gen]), {"base": base_bytes, "lora": lora_bytes}
        me = weights.layout.ranks[rank]
        merged = self.merged.setdefault(gen, {})
        merge_into(self.base[gen], adapters, self.engine.spec, gen, me.gen_tp_rank, me.gen_pp_rank,
                   self.engine.lora.scaling, merged)
        base = self.base[gen]
        return {**base, **merged}, {"base": base_bytes, "lora": lora_bytes}

    def gather_adapters(self) -> tuple[dict, int]:
        """Every layer's adapters whole on this rank (over TP, then over the pipeline stages), and the bytes
        this rank received doing so."""
        engine = self.engine
        g, layout = engine.groups, engine.layout
        stage = whole_adapters(engine.module(), engine.spec, layout.tp, g.tp_group, g.pp_rank, layout.pp)
        received = 0
        for adapter in engine.adapters.values():  # over TP: the other ranks' pieces of each cut side
            cut = adapter.lora_A if adapter.row_parallel else adapter.lora_B
            received += sum(p.numel() * p.element_size() for p in cut.values()) * (layout.tp - 1)
        if layout.pp == 1:
            return stage, received
        stages: list[dict] = [None] * layout.pp  # type: ignore[list-item]
        dist.all_gather_object(stages, {k: (a.cpu(), b.cpu()) for k, (a, b) in stage.items()}, group=g.pp_group)
        device = next(iter(stage.values()))[0].device
        out = {}
        for pp_rank, part in enumerate(stages):
            for key, (a, b) in part.items():
                out[key] = (a.to(device), b.to(device))
                if pp_rank != g.pp_rank:
                    received += a.numel() * a.element_size() + b.numel() * b.element_size()
        return out, received
