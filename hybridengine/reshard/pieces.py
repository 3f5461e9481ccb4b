"""One planner for every parameter group that travels point to point: what each generation rank needs, what it
already holds, and who sends the rest.

A *group* (``PieceGroup``: a mixture of experts' routed experts, LoRA adapters, or one of your own) names its
tensors by a key and describes each along one dimension of *units* (an expert's FFN units, an adapter's cut
rows or columns; a ``ShardGeometry``'s units). It says two things, both pure:

- ``wants(receiver)``: the (slot, key, units) a generation rank's shard holds, in its order;
- ``holdings(key)``: the key's units as training holds them, slice by slice, each with the training ranks that
  hold it (its data-parallel copies).

The planner then computes, for every receiver, the pieces of each want: a slice it already holds stays
where it is (colocated: a receiver is a training rank too); every other slice comes from one holder, the
least loaded so far (ties to the lowest rank), so copies share the sending. The bytes a receiver gets are
exactly what it needs and does not hold, unit by unit, which is the bound:

    bytes(r) = sum over its wants of |needed units \\ held units| x unit size

``PieceMover`` (``reshard.piece_mover``) moves a plan, colocated or across pools.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from hybridengine.model.geometry import ShardGeometry

__all__ = ["Holding", "Need", "Piece", "PieceGroup", "PiecePlan", "Want", "overlap", "plan_pieces"]

Units = tuple[int, int]  # [start, stop) along a tensor's unit dimension


def overlap(a: Units, b: Units | None) -> int:
    if b is None:
        return 0
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


class Want(NamedTuple):
    """Units ``units`` of the group's tensor ``key``, kept by the receiver at ``slot``."""

    slot: Any
    key: Any
    units: Units


class Holding(NamedTuple):
    """Units ``units`` of a key, held whole by each of the training ranks ``holders``."""

    units: Units
    holders: tuple[int, ...]


class _ReadsKey:
    """A key's own fields read through (``piece.layer``, ``need.expert`` for an expert's key)."""

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "key":
            raise AttributeError(name)
        try:
            return getattr(self.key, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r} (its key: {self.key!r})") from None


@dataclass(frozen=True)
class Piece(_ReadsKey):
    """Units ``units`` of tensor ``key``, sent by training rank ``source`` (the receiver itself when it holds them)."""

    key: Any
    units: Units
    source: int

    @property
    def size(self) -> int:
        return self.units[1] - self.units[0]


@dataclass(frozen=True)
class Need(_ReadsKey):
    """One want of a receiver, made of ``pieces`` in unit order."""

    slot: Any
    key: Any
    units: Units
    pieces: tuple[Piece, ...]


class PieceGroup(abc.ABC):
    """A kind of parameter that travels as pieces. Subclasses describe it; the planner and the mover do the rest.

    A key's tensors (``geometries``) are all cut along the same units: an expert's fc1 ([gate; up] rows) and fc2
    (columns); an adapter's one cut side.
    """

    kind: str
    label: str = ""  # how its figures are named (``reshard/{label}_bytes_received``); empty: the kind

    @abc.abstractmethod
    def wants(self, receiver: int) -> list[Want]:
        """What generation rank ``receiver``'s shard holds of this group, in its order."""

    @abc.abstractmethod
    def holdings(self, key) -> list[Holding]:
        """``key``'s units as training holds them, in unit order."""

    @abc.abstractmethod
    def geometries(self, key) -> tuple[ShardGeometry, ...]:
        """How each of ``key``'s tensors lays out its units."""

    @abc.abstractmethod
    def shapes(self, key, units: int) -> tuple[tuple[int, ...], ...]:
        """The shape of each of ``key``'s tensors when it holds ``units`` units."""

    @abc.abstractmethod
    def training_names(self, train_rank: int, key) -> tuple[str, ...]:
        """The names of ``key``'s tensors in training rank ``train_rank``'s parameters."""

    @abc.abstractmethod
    def generation_names(self, receiver: int, need: Need) -> tuple[str, ...]:
        """The names the receiver's assembled tensors of ``need`` take."""

    def together(self, key):
        """Wants whose keys give the same value here move in one chunk (a layer's experts, which an engine
        stacks into one tensor); None: no constraint."""
        return None

    def unit_numel(self, key) -> int:
        """Elements of one unit over all of ``key``'s tensors."""
        return sum(_numel(shape) for shape in self.shapes(key, 1))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class PiecePlan:
    group: PieceGroup
    needs: tuple[tuple[Need, ...], ...]  # per receiver, in its wants' order
    colocated: bool  # receivers are the training ranks themselves (they hold what they hold)

    def _units_bytes(self, pieces, element_size: int) -> int:
        return element_size * sum(p.size * self.group.unit_numel(p.key) for p in pieces)

    def bytes_received(self, receiver: int, element_size: int) -> int:
        """What the plan moves to ``receiver``: its pieces from other ranks."""
        return self._units_bytes((p for need in self.needs[receiver] for p in need.pieces
                                  if not self._own(receiver, p)), element_size)

    def bound(self, receiver: int, element_size: int) -> int:
        """The least ``receiver`` can receive: the units it needs and does not hold (the module's formula)."""
        total = 0
        for need in self.needs[receiver]:
            held = 0
            if self.colocated:
                held = sum(overlap(need.units, h.units) for h in self.group.holdings(need.key) if receiver in h.holders)
            total += (need.units[1] - need.units[0] - held) * self.group.unit_numel(need.key)
        return element_size * total

    def held_bytes(self, element_size: int) -> int:
        """What the generation shards take from the ranks' own training shards, summed over ranks."""
        return self._units_bytes((p for r, needs in enumerate(self.needs) for need in needs for p in need.pieces
                                  if self._own(r, p)), element_size)

    def _own(self, receiver: int, piece: Piece) -> bool:
        return self.colocated and piece.source == receiver

    def sends(self, train_rank: int) -> dict[int, list[tuple[Need, Piece]]]:
        """The pieces ``train_rank`` sends, by receiver, in the receiver's order."""
        out: dict[int, list[tuple[Need, Piece]]] = {}
        for receiver, needs in enumerate(self.needs):
            for need in needs:
                for piece in need.pieces:
                    if piece.source == train_rank and not self._own(receiver, piece):
                        out.setdefault(receiver, []).append((need, piece))
        return out

    def receives(self, receiver: int) -> dict[int, list[tuple[Need, Piece]]]:
        """The pieces ``receiver`` receives, by training rank, in its own order (what ``sends`` of each lists)."""
        out: dict[int, list[tuple[Need, Piece]]] = {}
        for need in self.needs[receiver]:
            for piece in need.pieces:
                if not self._own(receiver, piece):
                    out.setdefault(piece.source, []).append((need, piece))
        return out


def plan_pieces(group: PieceGroup, receivers: int, colocated: bool) -> PiecePlan:
    """``group``'s pieces for ``receivers`` generation ranks; ``colocated``: receiver r is training rank r and
    keeps what it holds."""
    sent: dict[int, int] = {}
    needs = []
    for receiver in range(receivers):
        mine = []
        for slot, key, units in group.wants(receiver):
            pieces = []
            for held, holders in group.holdings(key):  # the training slices the want spans
                part = (max(units[0], held[0]), min(units[1], held[1]))
                if part[0] >= part[1]:
                    continue
                if colocated and receiver in holders:
                    source = receiver
                else:
                    source = min(holders, key=lambda h: (sent.get(h, 0), h))
                    sent[source] = sent.get(source, 0) + part[1] - part[0]
                pieces.append(Piece(key, part, source))
            if sum(p.size for p in pieces) != units[1] - units[0]:
                raise ValueError(f"{group.kind} {key!r}: training holds only part of units {units}")
            mine.append(Need(slot, key, units, tuple(pieces)))
        needs.append(tuple(mine))
    return PiecePlan(group, tuple(needs), colocated)

