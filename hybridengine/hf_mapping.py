"""Hugging Face <-> megatron-core parameter mapping for Llama / Qwen2-family models.

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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from hybridengine.model_spec import ModelSpec

__all__ = ["ParamSource", "hf_source", "cut_shard", "merge_shards", "Reader"]

Reader = Callable[[str, tuple], torch.Tensor]  # (hf_name, index of slices) -> tensor

VOCAB_ROWS, REPLICATED, QKV, COLUMNS, FC1 = "vocab_rows", "replicated", "qkv", "columns", "fc1"

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LAYER_PARAMS = {
    "input_layernorm.weight": (REPLICATED, ["input_layernorm.weight"]),
    "pre_mlp_layernorm.weight": (REPLICATED, ["post_attention_layernorm.weight"]),
    "self_attention.linear_qkv.weight": (QKV, ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]),
    "self_attention.linear_qkv.bias": (QKV, ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]),
    "self_attention.linear_proj.weight": (COLUMNS, ["self_attn.o_proj.weight"]),
    "mlp.linear_fc1.weight": (FC1, ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    "mlp.linear_fc2.weight": (COLUMNS, ["mlp.down_proj.weight"]),
    # The transformer-engine spec fuses each norm into the linear layer after it.
    "self_attention.linear_qkv.layer_norm_weight": (REPLICATED, ["input_layernorm.weight"]),
    "mlp.linear_fc1.layer_norm_weight": (REPLICATED, ["post_attention_layernorm.weight"]),
}


@dataclass(frozen=True)
class ParamSource:
    kind: str
    hf_names: tuple[str, ...]


def hf_source(name: str, spec: ModelSpec, pp_rank: int, pipeline_parallel: int) -> ParamSource:
    """The HF tensors behind megatron parameter ``name`` on pipeline stage ``pp_rank``."""
    if name == "embedding.word_embeddings.weight":
        return ParamSource(VOCAB_ROWS, ("model.embed_tokens.weight",))
    if name == "decoder.final_layernorm.weight":
        return ParamSource(REPLICATED, ("model.norm.weight",))
    if name == "output_layer.weight":
        if spec.is_value_model:
            return ParamSource(REPLICATED, ("score.weight",))
        tied = spec.tie_word_embeddings
        return ParamSource(VOCAB_ROWS, ("model.embed_tokens.weight" if tied else "lm_head.weight",))
    match = _LAYER.match(name)
    if match and match.group(2) in _LAYER_PARAMS:
        layer = spec.layers_of_stage(pp_rank, pipeline_parallel)[int(match.group(1))]
        kind, suffixes = _LAYER_PARAMS[match.group(2)]
        return ParamSource(kind, tuple(f"model.layers.{layer}.{s}" for s in suffixes))
    raise KeyError(f"no Hugging Face source known for megatron parameter {name!r}")


def _qkv_rows(spec: ModelSpec, tp_rank: int, tp: int) -> tuple[slice, slice, int]:
    groups = spec.num_query_groups // tp
    heads_per_group = spec.num_attention_heads // spec.num_query_groups
    d = spec.head_dim
    first = tp_rank * groups
    q_rows = slice(first * heads_per_group * d, (first + groups) * heads_per_group * d)
    kv_rows = slice(first * d, (first + groups) * d)
    return q_rows, kv_rows, groups


def cut_shard(source: ParamSource, read: Reader, spec: ModelSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """The TP rank's shard of one megatron parameter, reading only what it needs."""
    kind, names = source.kind, source.hf_names
    if kind == REPLICATED:
        return read(names[0], ())
    if kind == VOCAB_ROWS:
        rows = spec.vocab_size // tp
        return read(names[0], (slice(tp_rank * rows, (tp_rank + 1) * rows),))
    if kind == COLUMNS:
        full_cols = spec.num_attention_heads * spec.head_dim if "o_proj" in names[0] else spec.ffn_hidden_size
        cols = full_cols // tp
        return read(names[0], (slice(None), slice(tp_rank * cols, (tp_rank + 1) * cols)))
    if kind == FC1:
        rows = spec.ffn_hidden_size // tp
        part = (slice(tp_rank * rows, (tp_rank + 1) * rows),)
        return torch.cat([read(names[0], part), read(names[1], part)])
    if kind == QKV:
        q_rows, kv_rows, groups = _qkv_rows(spec, tp_rank, tp)
        q, k, v = read(names[0], (q_rows,)), read(names[1], (kv_rows,)), read(names[2], (kv_rows,))
        tail = q.shape[1:]
        per_group = [t.reshape(groups, -1, *tail) for t in (q, k, v)]
        return torch.cat(per_group, dim=1).reshape(-1, *tail)
    raise ValueError(f"unknown mapping kind {kind!r}")


def merge_shards(source: ParamSource, shards: list[torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF tensors from the TP shards (in TP rank order) of one megatron parameter."""
    kind, names = source.kind, source.hf_names
    if kind == REPLICATED:
        return {names[0]: shards[0]}
    if kind == VOCAB_ROWS:
        return {names[0]: torch.cat(shards)}
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
    raise ValueError(f"unknown mapping kind {kind!r}")
