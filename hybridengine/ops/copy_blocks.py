"""Rectangular block copies into a flat buffer: the resharding layout transforms.

A block moves ``rows`` rows of ``cols`` elements from a flat source (rows
``src_stride`` apart, from ``src_offset``) to the flat output (rows
``dst_stride`` apart, from ``dst_offset``). A table of blocks expresses the
hybrid engine's transforms as one pass over the bytes: TP shards joined by
rows or columns, [gate_i; up_i] shards merged into [gate...; up...],
group-major QKV reordered into vLLM's [q; k; v]. With the op library built
the whole table runs as one kernel call (one launch on GPU); otherwise a loop
of torch copies does the same.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from hybridengine.ops.library import kernels_available, kernels_on

__all__ = ["Block", "copy_blocks", "copy_blocks_reference", "whole_block"]


class Block(NamedTuple):
    """One rectangular copy, in elements."""

    source: int
    src_offset: int
    src_stride: int
    dst_offset: int
    dst_stride: int
    rows: int
    cols: int


def whole_block(source: int, src_offset: int, dst_offset: int, numel: int) -> Block:
    """A contiguous run of ``numel`` elements."""
    return Block(source, src_offset, numel, dst_offset, numel, 1, numel)


def copy_blocks_reference(out: torch.Tensor, sources: Sequence[torch.Tensor], blocks: torch.Tensor) -> None:
    for source, src_offset, src_stride, dst_offset, dst_stride, rows, cols in blocks.tolist():
        if rows == 0 or cols == 0:
            continue
        src = sources[source].as_strided((rows, cols), (src_stride, 1), src_offset)
        out.as_strided((rows, cols), (dst_stride, 1), dst_offset).copy_(src)


if kernels_available():

    @torch.library.register_fake("hybridflow::copy_blocks")
    def _(out, sources, blocks):
        return None


def _table(blocks) -> torch.Tensor:
    if isinstance(blocks, torch.Tensor):
        return blocks.to(device="cpu", dtype=torch.int64).reshape(-1, 7)
    return torch.tensor([tuple(b) for b in blocks], dtype=torch.int64).reshape(-1, 7)


def copy_blocks(out: torch.Tensor, sources: Sequence[torch.Tensor], blocks) -> torch.Tensor:
    """Copies every block of ``blocks`` (``Block`` rows or an int64 [n, 7] table) into ``out``; returns ``out``.

    ``out`` and the sources are contiguous tensors of one dtype and device,
    addressed as flat arrays. Blocks must not overlap in ``out``.
    """
    if not out.is_contiguous():
        raise ValueError("copy_blocks: out must be contiguous (it is addressed as a flat array)")
    flat_out = out.view(-1)
    flat_sources = []
    for i, s in enumerate(sources):
        if not s.is_contiguous():
            raise ValueError(f"copy_blocks: source {i} of shape {tuple(s.shape)} is not contiguous")
        flat_sources.append(s.reshape(-1))
    table = _table(blocks)
    if kernels_on(out.device):
        torch.ops.hybridflow.copy_blocks(flat_out, flat_sources, table)
    else:
        copy_blocks_reference(flat_out, flat_sources, table)
    return out
