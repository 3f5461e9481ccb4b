"""Hugging Face <-> megatron-core parameter mapping for Llama / Qwen2 / Qwen3-family models.

Pure functions: given a megatron parameter name on one pipeline stage, which
HF tensors it comes from and how a tensor-parallel rank's shard is cut from
them; and the reverse, merging the TP shards of one megatron parameter back
into HF tensors. The shard is cut by reading only the rows (or columns) the
rank needs, through a ``read(hf_name, index)`` callback, so a loader backed by
safetensors' lazy slices never holds the full tensor.

Which HF tensors make up which megatron parameter, the shard shapes, and how
the shards are laid out (megatron-core's local spec: group-major QKV, SwiGLU
fc1 as ``[gate_r; up_r]`` per rank, vocabulary rows padded with zeros that
export drops, columns for linear_proj and linear_fc2, replicated norms) come
from the parameter catalogue (``hybridengine.model.catalogue``) and its shard
geometries (``hybridengine.model.geometry``), which do the cutting and joining.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridengine.model.catalogue import ExpertShard, ShardKind, lookup
from hybridengine.model.geometry import Reader, ShardGeometry
from hybridengine.model.spec import ModelSpec

__all__ = ["ParamSource", "Reader", "hf_source", "cut_shard", "merge_shards"]


@dataclass(frozen=True)
class ParamSource:
    kind: ShardKind | str
    hf_names: tuple[str, ...]
    name: str = ""  # the megatron parameter, for the shard shape at a TP size
    pp_rank: int = 0
    pipeline_parallel: int = 1
    geometry: ShardGeometry | None = None
    experts: ExpertShard | None = None  # the experts of the rank (routed-expert parameters)
    expert: int | None = None  # a routed expert's global index: cut over the ETP ranks

    @property
    def is_expert(self) -> bool:
        return self.expert is not None


def hf_source(name: str, spec: ModelSpec, pp_rank: int, pipeline_parallel: int,
              experts: ExpertShard | None = None) -> ParamSource:
    """The HF tensors behind megatron parameter ``name`` on pipeline stage ``pp_rank`` (a routed expert's on a
    rank holding ``experts``)."""
    param = lookup(name, spec, pp_rank, pipeline_parallel, experts=experts)
    return ParamSource(param.kind, param.hf_names, name, pp_rank, pipeline_parallel, param.geometry, experts,
                       param.expert)


def cut_shard(source: ParamSource, read: Reader, spec: ModelSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """The TP rank's shard of one megatron parameter, reading only what it needs. For a routed expert
    ``tp_rank`` / ``tp`` are the expert-tensor-parallel rank and size."""
    experts = ExpertShard(source.experts.ep, source.experts.ep_rank, tp) if source.is_expert else None
    shape = lookup(source.name, spec, source.pp_rank, source.pipeline_parallel, tp, experts).shape
    return source.geometry.cut(read, source.hf_names, tp_rank, shape)


def merge_shards(source: ParamSource, shards: list[torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF tensors from the TP shards (in TP rank order) of one megatron parameter."""
    return source.geometry.merge(shards, source.hf_names)
