"""Routed experts' pieces on the wire: cut from a training shard, packed into a message, unpacked, assembled.

A piece of units [a, b) of one expert (``expert_plan``'s unit: a gate row, an up row and a down column)
travels as its gate rows, its up rows and its down-projection columns, each flattened, 3 x (b - a) x hidden
elements. The colocated executor (``reshard.expert_resharder``) and the cross-pool transfer
(``cross_pool.transfer``) both move pieces this way.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybridengine.reshard.expert_plan import ExpertNeed, ExpertPiece

__all__ = ["Blocks", "assemble", "cut_piece", "pack", "unpack"]

Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate rows, up rows, down columns


def cut_piece(fc1: torch.Tensor, fc2: torch.Tensor, piece: ExpertPiece, offset: int) -> Blocks:
    """``piece``'s blocks from a training expert's fc1 ([gate; up]) and fc2, whose first unit is ``offset``."""
    width = fc2.shape[1]
    a, b = piece.units[0] - offset, piece.units[1] - offset
    return fc1[a:b], fc1[width + a: width + b], fc2[:, a:b]


def pack(blocks: Sequence[Blocks]) -> torch.Tensor:
    """One message of pieces, in order."""
    return torch.cat([part for gate, up, down in blocks for part in (gate.reshape(-1), up.reshape(-1), down.t().reshape(-1))])


def unpack(flat: torch.Tensor, pieces: Sequence[ExpertPiece], hidden: int) -> dict[int, Blocks]:
    """``id(piece)`` -> its blocks, views of ``flat`` (a message of ``pieces``, in order)."""
    out, cursor = {}, 0
    for piece in pieces:
        n = piece.size * hidden
        out[id(piece)] = (flat[cursor: cursor + n].view(piece.size, hidden),
                          flat[cursor + n: cursor + 2 * n].view(piece.size, hidden),
                          flat[cursor + 2 * n: cursor + 3 * n].view(piece.size, hidden).t())
        cursor += 3 * n
    return out


def assemble(need: ExpertNeed, blocks_of, hidden: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``need``'s generation fc1 [2 x width, hidden] and fc2 [hidden, width] from its pieces' blocks
    (``blocks_of(piece)``)."""
    width = need.units[1] - need.units[0]
    fc1 = torch.empty(2 * width, hidden, dtype=dtype, device=device)
    fc2 = torch.empty(hidden, width, dtype=dtype, device=device)
    for piece in need.pieces:
        gate, up, down = blocks_of(piece)
        a, b = piece.units[0] - need.units[0], piece.units[1] - need.units[0]
        fc1[a:b].copy_(gate)
        fc1[width + a: width + b].copy_(up)
        fc2[:, a:b].copy_(down)
    return fc1, fc2
