"""Joining and splitting megatron TP shards of one parameter, by mapping kind.

Joining r consecutive shards of a TP-t layout gives the shard of the TP-t/r
layout that covers them, for every kind: rows (vocab, group-major QKV) and
columns concatenate; SwiGLU fc1 shards [gate_i; up_i] join as
[gate_a; gate_b; up_a; up_b]; replicated tensors are taken as they are.
"""

from __future__ import annotations

import torch

from hybridengine.hf_mapping import COLUMNS, FC1, QKV, REPLICATED, VOCAB_ROWS

__all__ = ["join_tp_shards", "split_tp_shard", "join_into"]


def join_tp_shards(kind: str, shards: list[torch.Tensor]) -> torch.Tensor:
    if kind == REPLICATED or len(shards) == 1:
        return shards[0]
    if kind in (VOCAB_ROWS, QKV):
        return torch.cat(shards)
    if kind == COLUMNS:
        return torch.cat(shards, dim=1)
    if kind == FC1:
        gates, ups = zip(*(s.chunk(2) for s in shards))
        return torch.cat([*gates, *ups])
    raise ValueError(f"unknown mapping kind {kind!r}")


def join_into(out: torch.Tensor, kind: str, shards: list[torch.Tensor]) -> None:
    """``join_tp_shards`` written straight into ``out``, without a temporary."""
    if kind == REPLICATED or len(shards) == 1:
        out.copy_(shards[0])
        return
    if kind in (VOCAB_ROWS, QKV):
        pieces = out.split([s.shape[0] for s in shards])
    elif kind == COLUMNS:
        pieces = out.split([s.shape[1] for s in shards], dim=1)
    elif kind == FC1:
        half = out.shape[0] // 2
        gates = out[:half].split([s.shape[0] // 2 for s in shards])
        ups = out[half:].split([s.shape[0] // 2 for s in shards])
        for gate, up, shard in zip(gates, ups, shards):
            g, u = shard.chunk(2)
            gate.copy_(g)
            up.copy_(u)
        return
    else:
        raise ValueError(f"unknown mapping kind {kind!r}")
    for piece, shard in zip(pieces, shards):
        piece.copy_(shard)


def split_tp_shard(kind: str, tensor: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` of a shard: a view, except for fc1 (two row blocks)."""
    if kind == REPLICATED or parts == 1:
        return tensor
    if kind in (VOCAB_ROWS, QKV):
        return tensor.chunk(parts)[index]
    if kind == COLUMNS:
        return tensor.chunk(parts, dim=1)[index]
    if kind == FC1:
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(parts)[index], up.chunk(parts)[index]])
    raise ValueError(f"unknown mapping kind {kind!r}")
