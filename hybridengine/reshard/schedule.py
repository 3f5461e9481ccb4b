"""The micro-DP gather as a schedule of collectives, computed once per (plan, group): pure, no process group.

A generation shard is the join of its micro-DP group's training shards. The
schedule decides, for every byte, which member sends it, in which collective,
and where it lands in the flat generation buffer, so that executing it is a
loop over a few precomputed units with no per-parameter work.

* **Buffer order.** The buffer holds the generation parameters one after
  another, but in the schedule's order, not the generation stage's: the
  stage twins of a pipeline merge (the same local parameter of each merged
  training stage, equal in shape) lie side by side, so that member-major
  concatenation of what the members send is exactly the buffer's bytes.
* **In place.** Wherever that holds (row-joined parameters: vocabulary and
  group-major QKV rows; the gate and the up halves of SwiGLU fc1 when no
  stages merge; anything when TP does not merge), one all-gather writes the
  members' parts straight into the buffer: no staging, no second copy.
* **Staged.** Column-joined parameters (and fc1 across a pipeline merge)
  arrive in a staging area and are laid out by one ``copy_blocks`` pass.
  Parameters too small to repay a collective of their own are staged too,
  packed together, so the number of collectives stays small.
* **Local.** Where no stages merge, every member holds each replicated
  tensor (the norms) whole: it copies its own, and nothing moves.
* **Broadcast.** What only some members send (a replicated tensor across a
  merge, sent by its first holder; the edges of a pipeline merge without a
  twin, such as the last stage's final norm) goes by one broadcast per
  sending member: packed and staged when small, straight into the buffer
  when large.

Every member sends each byte it owns at most once, and no member sends a
byte that another member of the group also sends: each rank receives exactly
what ``weight_plan.expected_bytes_received`` counts, the lower bound.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from hybridengine.ops.copy_blocks import Block, whole_block
from hybridengine.model.geometry import Piece, join_blocks

__all__ = ["SendPiece", "GatherUnit", "GatherSchedule", "gather_schedule"]


@dataclass(frozen=True)
class SendPiece:
    """A contiguous run of one training parameter, flattened: ``length`` elements from ``start``."""

    name: str
    start: int
    length: int


@dataclass(frozen=True)
class GatherUnit:
    """One collective step of the schedule.

    ``sends[m]``: the runs member m sends, in order (its part is their
    concatenation). ``collective``: "all_gather" (equal parts) or "broadcast"
    (one broadcast from each member that sends anything; parts may differ).
    In place (``blocks`` empty), member m's part lands in the buffer at
    ``targets[m]``: for an all-gather, the parts are consecutive. Staged, the
    parts arrive in a staging area, one after another, and ``blocks`` (whose
    ``source`` is the member) lay them out.
    """

    collective: str
    sends: tuple[tuple[SendPiece, ...], ...]
    targets: tuple[int, ...] = ()
    blocks: tuple[Block, ...] = ()

    @property
    def in_place(self) -> bool:
        return not self.blocks

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sum(p.length for p in pieces) for pieces in self.sends)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def name(self) -> str:
        return f"{self.collective}{'' if self.in_place else '+staged'}"


@dataclass(frozen=True)
class GatherSchedule:
    offsets: dict[str, int]  # where each generation parameter starts in the flat buffer
    numel: int  # the buffer's length
    units: tuple[GatherUnit, ...]
    local: tuple[tuple[SendPiece, int], ...] = ()  # (own run, buffer offset): copied by every member itself

    def staging_numel(self) -> int:
        """The largest staged unit: the size of one staging area."""
        return max((u.numel for u in self.units if not u.in_place), default=0)

    def count(self, name: str) -> int:
        """How many units are of kind ``name`` (``GatherUnit.name``)."""
        return sum(u.name == name for u in self.units)


@dataclass
class _Item:
    """A piece of work before packing: per member, (run, the blocks that place it, relative to the run)."""

    runs: list[list[tuple[SendPiece, list[Block]]]]

    @property
    def sizes(self) -> list[int]:
        return [sum(r.length for r, _ in runs) for runs in self.runs]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def targets(self) -> tuple[int, ...] | None:
        """Where each member's part would start in the buffer, if every part is one contiguous run there."""
        targets = []
        for runs in self.runs:
            if len(runs) > 1 or any(len(b) != 1 or b[0].rows != 1 for _, b in runs):
                return None
            targets.append(runs[0][1][0].dst_offset if runs else -1)
        return tuple(targets)

    def consecutive(self) -> bool:
        """Equal parts that fill the buffer member after member, as an all-gather writes them."""
        targets, sizes = self.targets(), self.sizes
        return (targets is not None and len(set(sizes)) == 1
                and all(t == targets[0] + m * sizes[0] for m, t in enumerate(targets)))


def _twin_key(source, ordinal: dict) -> tuple:
    """Sources of different training stages with equal keys are stage twins (gathered together)."""
    name = source.train_names[0]
    if name.startswith("decoder.layers."):
        return ("layer", name)
    # Edge parameters (embedding, output layer, final norm) twin by kind and shape, in order.
    key = (str(source.param.kind), source.param.shape)
    n = ordinal[(source.stage, key)]
    ordinal[(source.stage, key)] += 1
    return ("edge", key, n)


def _placements(source, offset: int, d_g: int) -> list[list[tuple[SendPiece, list[Block]]]]:
    """Per member, (run, relative blocks) placing ``source`` at ``offset``; contiguous runs are cut apart."""
    runs: list[list[tuple[SendPiece, list[Block]]]] = [[] for _ in range(d_g)]
    name, shape = source.train_names[0], source.train_shapes[0]
    pieces = [Piece(m, 0, shape) for m in source.members]  # a replicated tensor: its first holder only
    blocks = join_blocks(source.param.geometry, pieces, offset, source.param.shape)
    for m in source.members:
        mine = [b for b in blocks if b.source == m]
        if all(b.rows == 1 or b.src_stride == b.cols == b.dst_stride for b in mine):
            for b in mine:  # contiguous runs (rows, fc1 halves): one send piece each, so each can land in place
                n = b.rows * b.cols
                runs[m].append((SendPiece(name, b.src_offset, n), [whole_block(m, 0, b.dst_offset, n)]))
        else:
            runs[m].append((SendPiece(name, 0, math.prod(shape)), mine))
    return runs


def _columns(runs: list[list], d_g: int) -> list[_Item]:
    """A twin set's runs as items: the j-th run of every member together when all members have as many."""
    counts = {len(r) for r in runs}
    if len(counts) != 1:
        return [_Item(runs)]
    columns = [_Item([[runs[m][j]] for m in range(d_g)]) for j in range(counts.pop())]
    return columns if all(c.consecutive() for c in columns) else [_Item(runs)]


def gather_schedule(sources: Sequence, source_shards: Sequence[tuple[int, int]], element_size: int,
                    bucket_bytes: int, in_place_min_bytes: int) -> GatherSchedule:
    """The schedule of one micro-DP group (the same on each of its members).

    ``sources``: the generation parameters (``weight_plan.generation_sources``);
    ``source_shards``: (tp, pp) of each member's training shard. Work of at
    least ``in_place_min_bytes`` goes in place where the layout allows; staged
    units hold at most ``bucket_bytes // 2`` each (two are in flight).
    """
    d_g = len(source_shards)
    ordinal: dict = defaultdict(int)
    by_key: dict[tuple, list] = {}
    for s in sources:
        by_key.setdefault(_twin_key(s, ordinal), []).append(s)
    offsets: dict[str, int] = {}
    offset = 0
    items: list[_Item] = []
    local: list[tuple[SendPiece, int]] = []
    one_stage = len({pp for _, pp in source_shards}) == 1
    for twins in by_key.values():
        if one_stage and twins[0].param.geometry.replicated:
            (s,) = twins
            offsets[s.param.name] = offset
            local.append((SendPiece(s.train_names[0], 0, s.param.numel), offset))
            offset += s.param.numel
            continue
        runs: list[list] = [[] for _ in range(d_g)]
        for s in sorted(twins, key=lambda s: s.stage):
            offsets[s.param.name] = offset
            for m, placed in enumerate(_placements(s, offset, d_g)):
                runs[m] += placed
            offset += s.param.numel
        items += _columns(runs, d_g)

    units: list[GatherUnit] = []
    staged_limit = max(1, bucket_bytes // 2 // element_size)  # two staging areas in flight: one bucket
    packs: dict[str, list[_Item]] = {"all_gather": [], "broadcast": []}

    def flush(collective: str) -> None:
        if packs[collective]:
            units.append(_staged(collective, packs[collective], d_g))
            packs[collective] = []

    for item in items:
        collective = "all_gather" if len(set(item.sizes)) == 1 else "broadcast"
        big = item.numel * element_size >= in_place_min_bytes
        if big and (item.consecutive() if collective == "all_gather" else item.targets() is not None):
            units.append(GatherUnit(collective, tuple(tuple(r for r, _ in runs) for runs in item.runs),
                                    targets=item.targets()))
            continue
        for chunk in _chunks(item, staged_limit):
            pack = packs[collective]
            if pack and sum(i.numel for i in pack) + chunk.numel > staged_limit:
                flush(collective)
            packs[collective].append(chunk)
    flush("all_gather")
    flush("broadcast")
    return GatherSchedule(offsets, offset, tuple(units), tuple(local))


def _chunks(item: _Item, limit: int) -> list[_Item]:
    """``item`` cut into pieces of at most about ``limit`` elements, by rows of every run alike, so a
    large staged parameter (or a stage-twin set of them) does not need a staging area of its size."""
    k = -(-item.numel // limit)
    if k <= 1:
        return [item]
    rows = max(b.rows if b.rows > 1 else b.cols for runs in item.runs for _, (b,) in runs)
    while True:  # rows do not always divide evenly: the fewest chunks that each fit
        chunks = _cut(item, k)
        if k >= rows or max(c.numel for c in chunks) <= limit:
            return chunks
        k += 1


def _cut(item: _Item, k: int) -> list[_Item]:
    chunks = []
    for j in range(k):
        runs = []
        for member_runs in item.runs:
            cut = []
            for run, (block,) in member_runs:
                if block.rows > 1:  # rows [a, b) of a 2-D block: contiguous in the source run
                    a, b = block.rows * j // k, block.rows * (j + 1) // k
                    piece = SendPiece(run.name, run.start + a * block.src_stride, (b - a) * block.cols)
                    placed = block._replace(dst_offset=block.dst_offset + a * block.dst_stride, rows=b - a)
                else:  # elements [a, b) of a contiguous run
                    a, b = block.cols * j // k, block.cols * (j + 1) // k
                    piece = SendPiece(run.name, run.start + a, b - a)
                    placed = whole_block(block.source, 0, block.dst_offset + a, b - a)
                if piece.length:
                    cut.append((piece, [placed]))
            runs.append(cut)
        chunks.append(_Item(runs))
    return chunks


def _staged(collective: str, items: list[_Item], d_g: int) -> GatherUnit:
    """Items packed into one staged unit: member m's runs one after another in its part."""
    sends: list[list[SendPiece]] = [[] for _ in range(d_g)]
    blocks: list[Block] = []
    cursor = [0] * d_g
    for item in items:
        for m, runs in enumerate(item.runs):
            for run, placed in runs:
                blocks += [b._replace(src_offset=b.src_offset + cursor[m]) for b in placed]
                sends[m].append(run)
                cursor[m] += run.length
    return GatherUnit(collective, tuple(map(tuple, sends)), blocks=tuple(blocks))
