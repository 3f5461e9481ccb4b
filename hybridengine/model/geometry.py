"""Shard geometry as data: how one parameter splits over tensor-parallel ranks, and every transform that follows.

Along one dimension (``dim``) a parameter is a run of *units*: rows of the
vocabulary, input columns, query groups, FFN rows. TP rank r of t holds units
[r n, (r+1) n), n = units / t. A parameter may be made of several Hugging
Face tensors, its *parts* (q, k, v; gate, up): ``parts`` gives each one's
extent along ``dim`` within one unit, and ``interleave`` how a shard lays
them out:

- ``"unit"``: unit after unit, each holding every part's block (megatron's
  group-major QKV: per query group, its query heads, key head, value head);
- ``"shard"``: part after part, each holding the shard's units of that part
  (SwiGLU fc1 ``[gate_r; up_r]``; vLLM's ``[q; k; v]`` per rank).

Units from ``real_units`` on are padding (megatron pads the vocabulary to a
multiple of its TP split): zero when cut from Hugging Face tensors, dropped
when merged back and in vLLM's layout. ``dim=None``: every rank holds the
whole tensor (norms).

Every transform the hybrid engine needs is written once here, from that
description alone: a shard cut from Hugging Face tensors, reading only its
rows (``cut``); the tensors merged back (``merge``); r consecutive shards
joined into the shard of the TP size r times smaller, as tensors
(``join_tp_shards``) or as block copies into a flat buffer
(``join_blocks``), and split back (``split_tp_shard``); and a shard in
vLLM's per-rank layout (``stacked``); and a piece's units of a shard (``unit_blocks``). A new kind of shard (experts, adapters,
a padded bias) is a new ``ShardGeometry``, not new code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from hybridengine.ops.copy_blocks import Block, copy_blocks, whole_block

__all__ = ["INTERLEAVES", "Piece", "Reader", "ShardGeometry", "join_blocks", "join_into", "join_tp_shards",
           "split_tp_shard"]

INTERLEAVES = ("unit", "shard")

Reader = Callable[[str, tuple], torch.Tensor]  # (Hugging Face name, index of slices) -> tensor


class Piece(NamedTuple):
    """A TP shard held as ``shape`` elements of flat source ``source`` from ``offset``."""

    source: int
    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardGeometry:
    kind: str  # a name for messages and for grouping like parameters (``catalogue.ShardKind`` for the built-in ones)
    dim: int | None = 0  # the dimension TP splits; None: replicated
    parts: tuple[int, ...] = (1,)  # each part's extent along ``dim`` in one unit
    interleave: str = "unit"  # "unit" or "shard" (see the module docstring)
    real_units: int | None = None  # units from here on are padding; None: none are

    def __post_init__(self) -> None:
        if self.interleave not in INTERLEAVES:
            raise ValueError(f"shard geometry {self.kind!r}: interleave {self.interleave!r} is not one of {INTERLEAVES}")
        if not self.parts or any(not isinstance(p, int) or p < 1 for p in self.parts):
            raise ValueError(f"shard geometry {self.kind!r}: parts {self.parts!r} must be positive integers")
        if self.dim is not None and self.dim < 0:
            raise ValueError(f"shard geometry {self.kind!r}: dim {self.dim} must be >= 0 (or None: replicated)")

    @property
    def replicated(self) -> bool:
        return self.dim is None

    @property
    def unit_size(self) -> int:
        return sum(self.parts)

    @property
    def stacks_parts(self) -> bool:
        """A shard holds several parts one after another (fc1 ``[gate_r; up_r]``): joining shards is not
        concatenating them."""
        return len(self.parts) > 1 and self.interleave == "shard"

    @property
    def _part_major(self) -> bool:
        """Parts lie one after another within a shard (one part, or interleave "shard")."""
        return len(self.parts) == 1 or self.interleave == "shard"

    def units(self, shape: Sequence[int]) -> int:
        """How many units a tensor of ``shape`` holds."""
        length = shape[self.dim]
        if length % self.unit_size:
            raise ValueError(f"a {self.kind} tensor of shape {tuple(shape)} is not whole units of {self.unit_size} "
                             f"along dim {self.dim}")
        return length // self.unit_size

    def real_units_of(self, units: int, tp_rank: int) -> int:
        """How many of TP rank ``tp_rank``'s ``units`` units are real (not padding)."""
        if self.real_units is None:
            return units
        return max(0, min(units, self.real_units - tp_rank * units))

    # ------------------------------------------------------------ Hugging Face
    def cut(self, read: Reader, names: Sequence[str], tp_rank: int, shard_shape: Sequence[int]) -> torch.Tensor:
        """TP rank ``tp_rank``'s shard (of ``shard_shape``), reading only its rows of the parts ``names``."""
        if self.replicated:
            return read(names[0], ())
        n = self.units(shard_shape)
        real = self.real_units_of(n, tp_rank)
        first, lead = tp_rank * n, (slice(None),) * self.dim
        pieces = []
        for name, size in zip(names, self.parts, strict=True):
            piece = read(name, (*lead, slice(first * size, (first + real) * size)))
            if real < n:  # padding units: zeros
                pad = list(piece.shape)
                pad[self.dim] = (n - real) * size
                piece = torch.cat([piece, piece.new_zeros(pad)], self.dim)
            pieces.append(piece)
        return self._assemble(pieces, n)

    def merge(self, shards: Sequence[torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The Hugging Face tensors ``names`` from every TP rank's shard, in rank order (padding dropped)."""
        if self.replicated:
            return {names[0]: shards[0]}
        full = join_tp_shards(self, list(shards))
        n = self.units(full.shape)
        real = n if self.real_units is None else self.real_units
        return {name: part.narrow(self.dim, 0, real * size).contiguous()
                for name, part, size in zip(names, self._split_parts(full, n), self.parts, strict=True)}

    def _split_parts(self, shard: torch.Tensor, n: int) -> list[torch.Tensor]:
        """Each part's rows of a shard of ``n`` units, part-major."""
        if self._part_major:
            return list(shard.split([n * size for size in self.parts], self.dim))
        grouped = shard.unflatten(self.dim, (n, self.unit_size)).split(list(self.parts), self.dim + 1)
        return [g.flatten(self.dim, self.dim + 1) for g in grouped]

    def _assemble(self, pieces: list[torch.Tensor], n: int) -> torch.Tensor:
        """A shard of ``n`` units from each part's rows (the inverse of ``_split_parts``)."""
        if len(pieces) == 1:
            return pieces[0]
        if self.interleave == "shard":
            return torch.cat(pieces, self.dim)
        grouped = [p.unflatten(self.dim, (n, size)) for p, size in zip(pieces, self.parts)]
        return torch.cat(grouped, self.dim + 1).flatten(self.dim, self.dim + 1)

    # ------------------------------------------------------------------ pieces
    def unit_blocks(self, tensor: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
        """Units [start, stop) of ``tensor`` (laid out as this geometry lays out a shard), one view per part
        where the parts lie apart ([gate; up]: the gate rows, then the up rows), else one view. What a
        point-to-point piece (``reshard.pieces``) sends, and where it lands."""
        if self.replicated:
            return [tensor]
        if not self.stacks_parts:
            return [tensor.narrow(self.dim, start * self.unit_size, (stop - start) * self.unit_size)]
        n, blocks, before = self.units(tensor.shape), [], 0
        for size in self.parts:
            blocks.append(tensor.narrow(self.dim, before * n + start * size, (stop - start) * size))
            before += size
        return blocks

    # -------------------------------------------------------------------- vLLM
    def stacked(self, shard: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """TP rank ``tp_rank``'s shard part-major with its real units only: vLLM's per-rank layout
        (``[q; k; v]``, ``[gate; up]``, the real vocabulary rows). A view where the layout allows it, else one
        block copy."""
        if self.replicated:
            return shard
        n = self.units(shard.shape)
        real = self.real_units_of(n, tp_rank)
        if self._part_major and (real == n or len(self.parts) == 1):
            return shard if real == n else shard.narrow(self.dim, 0, real * self.unit_size)
        runs = []  # (source position, target position, length), in units of ``dim``
        for p, size in enumerate(self.parts):
            before = sum(self.parts[:p])
            if self.interleave == "shard":
                runs.append((n * before, real * before, real * size))
            else:
                runs += [(u * self.unit_size + before, real * before + u * size, size) for u in range(real)]
        out_shape = list(shard.shape)
        out_shape[self.dim] = real * self.unit_size
        out = shard.new_empty(out_shape)
        copy_blocks(out.view(-1), [shard.contiguous().view(-1)], _runs_to_blocks(runs, 0, shard.shape, out_shape, self.dim))
        return out


def _runs_to_blocks(runs, source: int, src_shape: Sequence[int], dst_shape: Sequence[int], dim: int,
                    src_offset: int = 0, dst_offset: int = 0) -> list[Block]:
    """Block copies of runs (source position, target position, length) along ``dim`` between flat tensors."""
    outer, inner = math.prod(src_shape[:dim]), math.prod(src_shape[dim + 1:])
    src_len, dst_len = src_shape[dim], dst_shape[dim]
    if outer == 1:
        return [whole_block(source, src_offset + a * inner, dst_offset + b * inner, n * inner) for a, b, n in runs]
    return [Block(source, src_offset + a * inner, src_len * inner, dst_offset + b * inner, dst_len * inner, outer,
                  n * inner) for a, b, n in runs]


def join_tp_shards(geometry: ShardGeometry, shards: list[torch.Tensor]) -> torch.Tensor:
    """r consecutive TP shards joined into the one shard of the TP size r times smaller that covers them."""
    if geometry.replicated or len(shards) == 1:
        return shards[0]
    if not geometry.stacks_parts:
        return torch.cat(shards, geometry.dim)
    split = [geometry._split_parts(s, geometry.units(s.shape)) for s in shards]
    return torch.cat([parts[p] for p in range(len(geometry.parts)) for parts in split], geometry.dim)


def split_tp_shard(geometry: ShardGeometry, tensor: torch.Tensor, count: int, index: int) -> torch.Tensor:
    """Part ``index`` of ``count`` of a shard (the inverse of ``join_tp_shards``): a view, except where a
    shard stacks several parts (fc1: one block of each)."""
    if geometry.replicated or count == 1:
        return tensor
    if not geometry.stacks_parts:
        return tensor.chunk(count, geometry.dim)[index]
    parts = geometry._split_parts(tensor, geometry.units(tensor.shape))
    return torch.cat([p.chunk(count, geometry.dim)[index] for p in parts], geometry.dim)


def join_blocks(geometry: ShardGeometry, pieces: Sequence[Piece], dst_offset: int, out_shape: Sequence[int]) -> list[Block]:
    """The copies that write ``join_tp_shards(geometry, shards)`` into a flat buffer at ``dst_offset``.

    Each shard is a ``Piece``: a contiguous run of a flat source tensor. One
    ``copy_blocks`` call then joins any number of parameters in one pass.
    """
    if geometry.replicated or len(pieces) == 1:
        source, offset, shape = pieces[0]
        return [whole_block(source, offset, dst_offset, math.prod(shape))]
    dim, parts = geometry.dim, geometry.parts
    filled = [0] * len(parts)  # along dim: how much of each part's region of ``out`` the pieces so far filled
    blocks = []
    for source, offset, shape in pieces:
        if not geometry.stacks_parts:  # the pieces one after another
            runs = [(0, filled[0], shape[dim])]
            filled[0] += shape[dim]
        else:  # each piece's part p after the earlier pieces' part p
            n, out_n = geometry.units(shape), out_shape[dim] // geometry.unit_size
            runs = []
            for p, size in enumerate(parts):
                before = sum(parts[:p])
                runs.append((n * before, out_n * before + filled[p], n * size))
                filled[p] += n * size
        blocks += _runs_to_blocks(runs, source, shape, out_shape, dim, offset, dst_offset)
    return blocks


def join_into(out: torch.Tensor, geometry: ShardGeometry, shards: list[torch.Tensor]) -> None:
    """``join_tp_shards`` written straight into the contiguous ``out``, without a temporary."""
    shards = [s.contiguous() for s in shards]
    pieces = [Piece(i, 0, tuple(s.shape)) for i, s in enumerate(shards)]
    copy_blocks(out, shards, join_blocks(geometry, pieces, 0, tuple(out.shape)))
