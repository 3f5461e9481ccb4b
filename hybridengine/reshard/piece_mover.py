"""The one executor of a piece plan (``reshard.pieces``), for every group, colocated or across pools.

It decides nothing. A sending rank cuts each of its pieces out of its own training tensors (the units of its
held slice, by each tensor's ``ShardGeometry``) and packs the pieces of one receiver into one message; a
receiving rank posts one message from each sender, then assembles every want: the pieces it holds itself
are copied from its own tensors, the others from the messages. Each piece travels as its tensors' blocks,
flattened, in the key's tensor order. ``move_in_chunks`` does this a chunk of every receiver's wants at a
time (a bucket's bytes, a group's ``together`` wants never split), so a receiver holds one chunk's messages.

The messages go through ``exchange(sends, receives)``: point to point by peer, every pair's sizes known to
both sides (``Transport.exchange`` within one world; ``cross_pool.transfer`` across pools). Training tensors
are only read.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from hybridengine.reshard.pieces import Need, Piece, PiecePlan

__all__ = ["PieceMover"]

Exchange = Callable[[dict[int, torch.Tensor], dict[int, torch.Tensor]], None]


class PieceMover:
    """One rank's side of ``plan``: training rank ``train_rank`` (None: it sends nothing) and receiver
    ``receiver`` (None: it receives nothing; colocated, both are the rank). ``train_peer`` / ``receiver_peer``
    map the plan's ranks to the exchange's peers (default: the same numbers)."""

    def __init__(self, plan: PiecePlan, exchange: Exchange, train_rank: int | None, receiver: int | None,
                 train_peer: Callable[[int], int] = int, receiver_peer: Callable[[int], int] = int) -> None:
        self.plan, self.group, self.exchange = plan, plan.group, exchange
        self.train_rank, self.receiver = train_rank, receiver
        self.train_peer, self.receiver_peer = train_peer, receiver_peer
        self.sends = plan.sends(train_rank) if train_rank is not None else {}
        self.receives = plan.receives(receiver) if receiver is not None else {}
        self.bytes_sent = self.bytes_received = 0
        self._chunk_of: dict[int | None, dict[int, int]] = {}  # chunk size -> id(want) -> its chunk
        self._held_from: dict = {}  # key -> the first unit of the slice this training rank holds

    @classmethod
    def colocated(cls, plan: PiecePlan, rank: int, transport) -> "PieceMover":
        """Rank ``rank``'s side of a colocated plan, over ``transport`` (a ``reshard.transport.Transport``,
        which counts what this rank receives)."""
        return cls(plan, transport.exchange, rank, rank)

    def check(self, params: dict[str, torch.Tensor]) -> None:
        """Fail before any exchange if a tensor this rank sends or keeps is not among ``params``."""
        keys = {p.key for pieces in self.sends.values() for _, p in pieces}
        if self.receiver is not None:
            keys |= {p.key for need in self.plan.needs[self.receiver] for p in need.pieces if self._own(p)}
        for key in keys:
            for name in self.group.training_names(self.train_rank, key):
                if name not in params:
                    raise ValueError(f"{self.group.kind} parameter {name} missing from rank {self.train_rank}'s "
                                     f"training parameters")

    def _own(self, piece: Piece) -> bool:
        return self.plan.colocated and piece.source == self.receiver

    def _blocks(self, params: dict[str, torch.Tensor], piece: Piece) -> list[list[torch.Tensor]]:
        """``piece``'s blocks, per tensor of its key, cut from this rank's training tensors."""
        group, key = self.group, piece.key
        if key not in self._held_from:
            self._held_from[key] = next(h.units[0] for h in group.holdings(key) if self.train_rank in h.holders)
        start = self._held_from[key]
        a, b = piece.units[0] - start, piece.units[1] - start
        return [geometry.unit_blocks(params[name], a, b)
                for name, geometry in zip(group.training_names(self.train_rank, key), group.geometries(key))]

    def _pack(self, params: dict[str, torch.Tensor], pieces: list[tuple[Need, Piece]]) -> torch.Tensor:
        return torch.cat([block.reshape(-1) for _, piece in pieces for blocks in self._blocks(params, piece)
                          for block in blocks])

    def _unpack(self, flat: torch.Tensor, pieces: list[tuple[Need, Piece]]) -> dict[int, list[torch.Tensor]]:
        """``id(piece)`` -> its tensors (views of ``flat``), each shaped as the key's tensor of its units."""
        out, cursor = {}, 0
        for _, piece in pieces:
            tensors = []
            for shape in self.group.shapes(piece.key, piece.size):
                n = 1
                for s in shape:
                    n *= s
                tensors.append(flat[cursor: cursor + n].view(shape))
                cursor += n
            out[id(piece)] = tensors
        return out

    def move(self, params: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
             device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Send this rank's pieces and receive its wants, assembled under their generation names (empty for a
        rank that only sends). ``params``: this rank's training tensors by name (empty for a pure receiver);
        ``dtype`` / ``device`` of what arrives (default: those of ``params``)."""
        out: dict[str, torch.Tensor] = {}
        for chunk in self.move_in_chunks(params, None, dtype, device):
            out.update(chunk)
        return out

    def chunks(self, receiver: int, chunk_elements: int | None) -> list[int]:
        """Receiver ``receiver``'s wants cut into consecutive chunks of at most ``chunk_elements`` elements (a
        larger want alone, and wants the group keeps ``together`` in one): the chunk of each want, in order.
        Every rank computes the same."""
        out, chunk, size, last = [], 0, 0, object()
        for need in self.plan.needs[receiver]:
            n = (need.units[1] - need.units[0]) * self.group.unit_numel(need.key)
            together = self.group.together(need.key)
            if (chunk_elements is not None and size and size + n > chunk_elements
                    and (together is None or together != last)):
                chunk, size = chunk + 1, 0
            out.append(chunk)
            size, last = size + n, together
        return out

    def move_in_chunks(self, params: dict[str, torch.Tensor], chunk_bytes: int | None,
                       dtype: torch.dtype | None = None, device: torch.device | str | None = None
                       ) -> Iterator[dict[str, torch.Tensor]]:
        """``move`` a chunk of every receiver's wants at a time (``chunk_bytes`` each at most, a larger want
        alone; None: one chunk), one exchange per chunk, yielding this rank's assembled chunk (empty for a
        rank that only sends) before the next is received. Collective: consume it to the end."""
        if (dtype is None or device is None) and params:
            probe = next(iter(params.values()))
            dtype, device = dtype or probe.dtype, device or probe.device
        # a rank that neither sends nor receives walks the chunks idle, whatever their size
        element = torch.empty((), dtype=dtype).element_size() if dtype is not None else 1
        limit = None if chunk_bytes is None else max(chunk_bytes // element, 1)
        if limit not in self._chunk_of:  # each want's chunk, the same on every rank, worked out once
            self._chunk_of[limit] = {id(need): c for r, needs in enumerate(self.plan.needs)
                                     for need, c in zip(needs, self.chunks(r, limit))}
        chunk_of = self._chunk_of[limit]
        count = max(chunk_of.values(), default=-1) + 1
        for c in range(count):
            def this(pieces):
                return [(need, piece) for need, piece in pieces if chunk_of[id(need)] == c]

            sends = {self.receiver_peer(r): self._pack(params, mine) for r, pieces in self.sends.items()
                     if (mine := this(pieces))}
            taken = {t: mine for t, pieces in self.receives.items() if (mine := this(pieces))}
            receives = {self.train_peer(t): torch.empty(sum(p.size * self.group.unit_numel(p.key) for _, p in pieces),
                                                        dtype=dtype, device=device)
                        for t, pieces in taken.items()}
            self.exchange(sends, receives)
            self.bytes_sent += sum(t.numel() * t.element_size() for t in sends.values())
            self.bytes_received += sum(t.numel() * t.element_size() for t in receives.values())
            if self.receiver is None:
                yield {}
                continue
            arrived: dict[int, list[torch.Tensor]] = {}
            for t, pieces in taken.items():
                arrived.update(self._unpack(receives[self.train_peer(t)], pieces))
            out = {}
            for need in self.plan.needs[self.receiver]:
                if chunk_of[id(need)] == c:
                    out.update(self._assemble(need, params, arrived, dtype, device))
            yield out

    def _assemble(self, need: Need, params, arrived, dtype, device) -> dict[str, torch.Tensor]:
        group = self.group
        geometries = group.geometries(need.key)
        tensors = [torch.empty(shape, dtype=dtype, device=device)
                   for shape in group.shapes(need.key, need.units[1] - need.units[0])]
        for piece in need.pieces:
            a, b = piece.units[0] - need.units[0], piece.units[1] - need.units[0]
            if self._own(piece):
                sources = self._blocks(params, piece)
            else:
                sources = [g.unit_blocks(t, 0, piece.size) for g, t in zip(geometries, arrived[id(piece)])]
            for tensor, geometry, blocks in zip(tensors, geometries, sources):
                for target, block in zip(geometry.unit_blocks(tensor, a, b), blocks):
                    target.copy_(block)
        return dict(zip(group.generation_names(self.receiver, need), tensors))
