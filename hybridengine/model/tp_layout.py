"""Joining and splitting megatron TP shards of one parameter, by mapping kind.

Joining r consecutive shards of a TP-t layout gives the shard of the TP-t/r
layout that covers them, for every kind: rows (vocab, group-major QKV) and
columns concatenate; SwiGLU fc1 shards [gate_i; up_i] join as
[gate_a; gate_b; up_a; up_b]; replicated tensors are taken as they are.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from hybridengine.model.hf_mapping import COLUMNS, FC1, QKV, REPLICATED, VOCAB_ROWS
from hybridengine.model.catalogue import ShardKind
from hybridengine.ops.copy_blocks import Block, copy_blocks, whole_block

__all__ = ["Piece", "join_blocks", "join_into", "join_tp_shards", "split_tp_shard"]


class Piece(NamedTuple):
    """A TP shard held as ``shape`` elements of flat source ``source`` from ``offset``."""

    source: int
    offset: int
    shape: tuple[int, ...]


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
    raise ValueError(f"unknown shard kind {kind!r}; valid: {[k.value for k in ShardKind]}")


def join_blocks(kind: str, pieces: Sequence[Piece], dst_offset: int, out_shape: Sequence[int]) -> list[Block]:
    """The copies that write ``join_tp_shards(kind, shards)`` into a flat buffer at ``dst_offset``.

    Each shard is a ``Piece``: a contiguous run of a flat source tensor. One
    ``copy_blocks`` call then joins any number of parameters in one pass.
    """
    if kind == REPLICATED or len(pieces) == 1:
        source, offset, shape = pieces[0]
        return [whole_block(source, offset, dst_offset, math.prod(shape))]
    blocks = []
    if kind in (VOCAB_ROWS, QKV):
        for source, offset, shape in pieces:
            blocks.append(whole_block(source, offset, dst_offset, math.prod(shape)))
            dst_offset += math.prod(shape)
    elif kind == COLUMNS:
        rows, width = out_shape
        for source, offset, (_, cols) in pieces:
            blocks.append(Block(source, offset, cols, dst_offset, width, rows, cols))
            dst_offset += cols
    elif kind == FC1:
        up_start = math.prod(out_shape) // 2
        for source, offset, shape in pieces:
            half = math.prod(shape) // 2
            blocks.append(whole_block(source, offset, dst_offset, half))
            blocks.append(whole_block(source, offset + half, dst_offset + up_start, half))
            dst_offset += half
    else:
        raise ValueError(f"unknown shard kind {kind!r}; valid: {[k.value for k in ShardKind]}")
    return blocks


def join_into(out: torch.Tensor, kind: str, shards: list[torch.Tensor]) -> None:
    """``join_tp_shards`` written straight into the contiguous ``out``, without a temporary."""
    shards = [s.contiguous() for s in shards]
    pieces = [Piece(i, 0, tuple(s.shape)) for i, s in enumerate(shards)]
    copy_blocks(out, shards, join_blocks(kind, pieces, 0, tuple(out.shape)))


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
    raise ValueError(f"unknown shard kind {kind!r}; valid: {[k.value for k in ShardKind]}")
