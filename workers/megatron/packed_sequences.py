"""Packed sequences, split over the context-parallel ranks: where a micro-batch's tokens lie on one CP rank.

A packed micro-batch (THD) is its rows back to back in one row of tokens,
with no padding rows: megatron sees ``[1, T]`` tokens and a ``PackedSeqParams``
whose ``cu_seqlens`` mark where each row's tokens start. Each row keeps its
own positions (0, 1, ... within the row) and attends only to itself.

With context parallelism each row is further cut into ``2 x CP`` equal chunks
(its length rounded up to a multiple of ``2 x CP``) and CP rank r holds
chunks r and ``2CP - 1 - r``: megatron's load-balanced split, so every rank
does the same causal attention work (an early chunk attends to little, its
partner to much). The rounding pads a row at its end, where the causal mask
hides it from the row's real tokens.

``SequenceSplit`` is the PackedSeqParams the engine hands megatron, laid out
as megatron's own context parallelism lays out THD (and transformer-engine's
attention reads it): ``cu_seqlens_q_padded`` at the rows' padded boundaries
over all CP ranks, ``cu_seqlens_q`` at their real lengths, this rank holding a
CP-th of each row in the order above. megatron's RoPE finds each local
token's position from them and the CP group. Besides, it carries what the
engine's core attention (``workers.megatron.context_attention``) needs to find
each row's keys among the K/V gathered from the CP group. Everything here is
host-side index arithmetic, done once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.core.packed_seq_params import PackedSeqParams

__all__ = ["QueryPiece", "SequenceSplit", "split_rows", "padded_length"]


def padded_length(length: int, cp: int) -> int:
    """A row of ``length`` tokens rounded up to a multiple of 2 x CP (CP 1: as it is)."""
    if cp == 1:
        return length
    return -(-max(length, 1) // (2 * cp)) * (2 * cp)


@dataclass(frozen=True)
class QueryPiece:
    """Consecutive query tokens of one row on this rank: local tokens [start, start + count), holding the row's
    positions [first, first + count); they attend to the row's keys [0, first + count)."""

    row: int
    start: int
    count: int
    first: int


@dataclass
class SequenceSplit(PackedSeqParams):
    """megatron's packed-sequence parameters for one micro-batch on one CP rank, and the row structure behind them.

    ``positions`` [T]: each local token's position in its row. ``pieces``: the local query pieces;
    ``key_index[row]``: the row's tokens in order among the K/V gathered over the CP group (None at CP 1: the
    row's keys are its local tokens ``row_start[row]`` on). ``context_group``: the CP group (megatron's
    ``cp_group`` too, where CP > 1).
    """

    positions: torch.Tensor | None = None
    pieces: tuple[QueryPiece, ...] = ()
    key_index: tuple[torch.Tensor | None, ...] = ()
    row_start: tuple[int, ...] = ()
    row_length: tuple[int, ...] = ()
    context_parallel: int = 1
    context_group: Any = field(default=None, repr=False)
    masks: dict = field(default_factory=dict, repr=False)  # the attention's per-piece masks, built once (CPU)


def _row_chunks(length: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """(first position, count) of the chunks of a row of padded ``length`` that CP rank ``rank`` holds."""
    if cp == 1:
        return [(0, length)]
    chunk = length // (2 * cp)
    return [(rank * chunk, chunk), ((2 * cp - 1 - rank) * chunk, chunk)]


def split_rows(ids: torch.Tensor, valid: torch.Tensor, response_index: torch.Tensor, cp: int, cp_rank: int,
               pad_rows: bool, context_group: Any = None) -> tuple[torch.Tensor, torch.Tensor, SequenceSplit]:
    """The packed tokens of rolled rows ``ids`` [B, W] (row i's ``valid[i]`` tokens first) on CP rank ``cp_rank``.

    ``pad_rows``: each row keeps the micro-batch's width W (an unpacked micro-batch under CP); else each row
    is its own valid length (packed). Returns the local tokens [1, T], ``response_local`` [B, R] (where each
    position in ``response_index`` lies among the local tokens; -1 where another CP rank holds it) and the
    ``SequenceSplit``.
    """
    rows, width = ids.shape
    lengths = [padded_length(width if pad_rows else max(int(n), 1), cp) for n in valid.tolist()]
    device = ids.device
    token_parts, position_parts, pieces, row_start = [], [], [], []
    local = 0
    # where each (row, position) lies locally: -1 where another rank holds it
    where = [torch.full((n,), -1, dtype=torch.long) for n in lengths]
    for row, length in enumerate(lengths):
        row_ids = ids[row, :length]
        if row_ids.shape[0] < length:  # rounded up past the micro-batch's width: padding at the row's end
            row_ids = torch.nn.functional.pad(row_ids, (0, length - row_ids.shape[0]))
        row_start.append(local)
        for first, count in _row_chunks(length, cp, cp_rank):
            token_parts.append(row_ids[first:first + count])
            position_parts.append(torch.arange(first, first + count))
            where[row][first:first + count] = torch.arange(local, local + count)
            if pieces and pieces[-1].row == row and pieces[-1].first + pieces[-1].count == first:
                last = pieces[-1]  # contiguous with the previous piece (the two middle chunks of the last rank)
                pieces[-1] = QueryPiece(row, last.start, last.count + count, last.first)
            else:
                pieces.append(QueryPiece(row, local, count, first))
            local += count
    tokens = torch.cat(token_parts).unsqueeze(0).to(device)
    positions = torch.cat(position_parts).to(device)
    key_index = tuple(_key_index(length, cp, row_start[row], local) if cp > 1 else None
                      for row, length in enumerate(lengths))
    response_local = torch.stack([where[row][response_index[row].clamp(0, lengths[row] - 1).cpu()]
                                  for row in range(rows)]).to(device) if rows else response_index
    real = [min(max(int(n), 1), length) for n, length in zip(valid.tolist(), lengths)]
    padded, actual = _cumulative(lengths, device), _cumulative(real, device)
    split = SequenceSplit(
        qkv_format="thd", cu_seqlens_q=actual, cu_seqlens_kv=actual, cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
        cp_group=context_group if cp > 1 else None, positions=positions, pieces=tuple(pieces), key_index=key_index,
        row_start=tuple(row_start), row_length=tuple(lengths), context_parallel=cp, context_group=context_group,
    )
    return tokens, response_local, split


def _cumulative(values: list[int], device) -> torch.Tensor:
    """megatron's cu_seqlens: 0 and the running sum of ``values``, int32."""
    return torch.tensor([0, *torch.tensor(values).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _key_index(length: int, cp: int, row_start: int, local_tokens: int) -> torch.Tensor:
    """A row's tokens in position order among the K/V gathered over the CP group (rank j's local tokens at
    j x ``local_tokens``; the row starts at ``row_start`` on every rank, its chunks in ``_row_chunks`` order)."""
    chunk = length // (2 * cp)
    parts = []
    for k in range(2 * cp):
        rank, second = (k, 0) if k < cp else (2 * cp - 1 - k, 1)
        start = rank * local_tokens + row_start + second * chunk
        parts.append(torch.arange(start, start + chunk))
    return torch.cat(parts)
