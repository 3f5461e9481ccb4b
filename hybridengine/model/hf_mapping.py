"""Hugging Face <-> megatron-core parameter mapping for Llama / Qwen2 / Qwen3-family models.

Pure functions: given a megatron parameter name on one pipeline stage, which
HF tensors it comes from and how a tensor-parallel rank's shard is cut from
them; and the reverse, merging the TP shards of one megatron parameter back
into HF tensors. The shard is cut by reading only the rows (or columns) the
rank needs, through a ``read(hf_name, index)`` callback, so a loader backed by
safetensors' lazy slices never holds the full tensor.

Layouts (megatron-core local spec):
  - linear_qkv is group-major: for each query group, its query heads, then its
    key head, then its value head; TP splits contiguously along groups.
  - linear_fc1 (SwiGLU) holds [gate_r; up_r] per TP rank: shard r at TP=N is
    cat(gate.chunk(N)[r], up.chunk(N)[r]).
  - embeddings and output layer are vocab-sharded (rows); linear_proj and
    linear_fc2 split their input dimension (columns); norms are replicated.
  - a padded vocabulary (``ModelSpec.vocab_rows`` > ``vocab_size``) gets zero
    rows on import; export drops them, so the HF tensors come back bit-exact.

Which HF tensors make up which megatron parameter, and the shard shapes,
come from the parameter catalogue (``hybridengine.model.catalogue``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hybridengine.model.spec import ModelSpec
from hybridengine.model.catalogue import ShardKind, lookup

__all__ = ["ParamSource", "hf_source", "cut_shard", "merge_shards", "Reader",
           "VOCAB_ROWS", "REPLICATED", "QKV", "COLUMNS", "FC1"]

Reader = Callable[[str, tuple], torch.Tensor]  # (hf_name, index of slices) -> tensor

# The shard kinds under their historical names.
VOCAB_ROWS, REPLICATED, QKV, COLUMNS, FC1 = (
    ShardKind.VOCAB_ROWS, ShardKind.REPLICATED, ShardKind.QKV, ShardKind.COLUMNS, ShardKind.FC1)


@dataclass(frozen=True)
class ParamSource:
    kind: ShardKind
    hf_names: tuple[str, ...]
    name: str = ""  # the megatron parameter, for the shard shape at a TP size
    pp_rank: int = 0
    pipeline_parallel: int = 1


def hf_source(name: str, spec: ModelSpec, pp_rank: int, pipeline_parallel: int) -> ParamSource:
    """The HF tensors behind megatron parameter ``name`` on pipeline stage ``pp_rank``."""
    param = lookup(name, spec, pp_rank, pipeline_parallel)
    return ParamSource(param.kind, param.hf_names, name, pp_rank, pipeline_parallel)


def _shard_shape(source: ParamSource, spec: ModelSpec, tp: int) -> tuple[int, ...]:
    return lookup(source.name, spec, source.pp_rank, source.pipeline_parallel, tp).shape


def _qkv_rows(spec: ModelSpec, tp_rank: int, tp: int) -> tuple[slice, slice, int]:
    groups = spec.num_query_groups // tp
    heads_per_group = spec.num_attention_heads // spec.num_query_groups
    d = spec.head_dim
    first = tp_rank * groups
    q_rows = slice(first * heads_per_group * d, (first + groups) * heads_per_group * d)
    kv_rows = slice(first * d, (first + groups) * d)
    return q_rows, kv_rows, groups


def _vocab_shard(read: Reader, name: str, spec: ModelSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank r's rows of the padded vocabulary: the real ones read, padding rows zero."""
    rows = spec.vocab_rows // tp
    start, end = spec.real_vocab_rows(tp, tp_rank)
    real = read(name, (slice(start, end),))  # empty (but typed) on a rank of padding only
    if real.shape[0] == rows:
        return real
    out = real.new_zeros(rows, *real.shape[1:])
    out[: real.shape[0]] = real
    return out


def cut_shard(source: ParamSource, read: Reader, spec: ModelSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """The TP rank's shard of one megatron parameter, reading only what it needs."""
    kind, names = source.kind, source.hf_names
    if kind == REPLICATED:
        return read(names[0], ())
    shape = _shard_shape(source, spec, tp)
    if kind == VOCAB_ROWS:
        return _vocab_shard(read, names[0], spec, tp_rank, tp)
    if kind == COLUMNS:
        cols = shape[1]
        return read(names[0], (slice(None), slice(tp_rank * cols, (tp_rank + 1) * cols)))
    if kind == FC1:
        rows = shape[0] // 2
        part = (slice(tp_rank * rows, (tp_rank + 1) * rows),)
        return torch.cat([read(names[0], part), read(names[1], part)])
    if kind == QKV:
        q_rows, kv_rows, groups = _qkv_rows(spec, tp_rank, tp)
        q, k, v = read(names[0], (q_rows,)), read(names[1], (kv_rows,)), read(names[2], (kv_rows,))
        tail = q.shape[1:]
        per_group = [t.reshape(groups, -1, *tail) for t in (q, k, v)]
        return torch.cat(per_group, dim=1).reshape(-1, *tail)
    raise ValueError(f"unknown shard kind {kind!r}; valid: {[k.value for k in ShardKind]}")


def merge_shards(source: ParamSource, shards: list[torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF tensors from the TP shards (in TP rank order) of one megatron parameter."""
    kind, names = source.kind, source.hf_names
    if kind == REPLICATED:
        return {names[0]: shards[0]}
    if kind == VOCAB_ROWS:
        return {names[0]: torch.cat(shards)[: spec.vocab_size]}  # padding rows are not part of the model
    if kind == COLUMNS:
        return {names[0]: torch.cat(shards, dim=1)}
    if kind == FC1:
        gates, ups = zip(*(s.chunk(2) for s in shards))
        return {names[0]: torch.cat(gates), names[1]: torch.cat(ups)}
    if kind == QKV:
        heads_per_group = spec.num_attention_heads // spec.num_query_groups
        d = spec.head_dim
        tail = shards[0].shape[1:]
        grouped = torch.cat([s.reshape(-1, (heads_per_group + 2) * d, *tail) for s in shards])
        q, k, v = grouped.split([heads_per_group * d, d, d], dim=1)
        return {n: t.reshape(-1, *tail) for n, t in zip(names, (q, k, v))}
    raise ValueError(f"unknown shard kind {kind!r}; valid: {[k.value for k in ShardKind]}")
