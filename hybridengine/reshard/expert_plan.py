"""The 3D-HybridEngine over a mixture of experts' routed experts: for every rank, what its generation shard
needs of the experts, what it already holds, and the point-to-point pieces that bring the rest.

The dense weights (attention, norms, the router, a shared expert) go through the micro-DP plan
(``reshard.weight_plan``). Routed experts do not fit it: training holds them on the expert grid (EP x ETP,
folded over TP x DP), generation on the generation TP ranks, so the ranks that hold what a generation
rank needs are not its micro-DP peers. This plan reads both grids and is pure, like the dense one.

Everything about an expert lies along its FFN units: unit u is row u of the gate and of the up projection
(fc1) and column u of the down projection (fc2), 3 x hidden elements. A rank holds, for each layer of its
training stage and each expert of its EP rank, the units of its ETP slice. A generation rank needs, for each
layer of its generation stage,

- every expert's units of its generation TP slice (experts cut across generation TP), or
- all units of the experts placed on it (whole experts, ``GenerationLayout.expert_parallel``).

**The bound**: a rank receives exactly what it needs and does not hold, unit by unit:

    bytes(r) = sum over (layer, expert) it needs of |needed units \\ held units| x 3 x hidden x element size

Under expert parallelism in generation the placement is free: generation expert k may be any training
expert, if the router's rows move with it. ``placement`` is the one that maximizes what the ranks hold
in total (an assignment problem over blocks of interchangeable experts), and vLLM's linear placement where
that is as good. Every missing piece comes from one rank that holds it (the least loaded sender first),
so the bytes received equal the bound by construction, and the tests count them against the formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout, divisors
from hybridengine.reshard.assignment import max_value_assignment
from hybridengine.reshard.plan import GenerationLayout, ReshardLayoutError, ReshardPlan, plan_reshard

__all__ = ["EXPERT_UNIT_ROWS", "ExpertNeed", "ExpertPiece", "ExpertPlan", "check_expert_split", "expert_placement", "held_units",
           "linear_bound", "plan_experts"]

EXPERT_UNIT_ROWS = 3  # per FFN unit: a gate row, an up row, a down column, each of hidden size

Units = tuple[int, int]  # [start, stop) along the expert's FFN dimension


@dataclass(frozen=True)
class ExpertPiece:
    """Units ``units`` of training expert ``expert`` in ``layer``, sent by ``source`` (the receiver itself
    when it holds them)."""

    layer: int
    expert: int
    units: Units
    source: int

    @property
    def size(self) -> int:
        return self.units[1] - self.units[0]


@dataclass(frozen=True)
class ExpertNeed:
    """One expert of a rank's generation shard: generation expert ``slot`` of ``layer`` is training expert
    ``expert``, of which the rank needs ``units``, made of ``pieces`` in unit order."""

    layer: int
    slot: int
    expert: int
    units: Units
    pieces: tuple[ExpertPiece, ...]


@dataclass(frozen=True)
class ExpertPlan:
    spec: ModelSpec
    layout: ReshardPlan
    placement: tuple[int, ...]  # generation expert k -> training (HF) expert; the identity unless generation EP
    needs: tuple[tuple[ExpertNeed, ...], ...]  # per rank, in (layer, slot) order

    @property
    def train(self) -> ParallelLayout:
        return self.layout.train

    @property
    def gen(self) -> GenerationLayout:
        return self.layout.gen

    def unit_bytes(self, element_size: int) -> int:
        return EXPERT_UNIT_ROWS * self.spec.hidden_size * element_size

    def bytes_received(self, rank: int, element_size: int) -> int:
        """What the plan moves to ``rank``: its pieces from other ranks."""
        return self.unit_bytes(element_size) * sum(
            p.size for need in self.needs[rank] for p in need.pieces if p.source != rank)

    def bound(self, rank: int, element_size: int) -> int:
        """The least ``rank`` can receive: the units it needs and does not hold (the module's formula)."""
        missing = 0
        for need in self.needs[rank]:
            held = held_units(self.spec, self.train, rank, need.layer, need.expert)
            missing += need.units[1] - need.units[0] - _overlap(need.units, held)
        return self.unit_bytes(element_size) * missing

    def held_bytes(self, element_size: int) -> int:
        """What the generation shards take from the ranks' own training shards, summed over ranks."""
        return self.unit_bytes(element_size) * sum(
            p.size for rank, needs in enumerate(self.needs) for need in needs for p in need.pieces if p.source == rank)

    def sends(self, rank: int) -> dict[int, list[tuple[ExpertNeed, ExpertPiece]]]:
        """The pieces ``rank`` sends, by receiver, in the receiver's order."""
        out: dict[int, list[tuple[ExpertNeed, ExpertPiece]]] = {}
        for receiver, needs in enumerate(self.needs):
            if receiver == rank:
                continue
            for need in needs:
                for piece in need.pieces:
                    if piece.source == rank:
                        out.setdefault(receiver, []).append((need, piece))
        return out

    def receives(self, rank: int) -> dict[int, list[tuple[ExpertNeed, ExpertPiece]]]:
        """The pieces ``rank`` receives, by sender, in its own order (what ``sends`` of each sender lists)."""
        out: dict[int, list[tuple[ExpertNeed, ExpertPiece]]] = {}
        for need in self.needs[rank]:
            for piece in need.pieces:
                if piece.source != rank:
                    out.setdefault(piece.source, []).append((need, piece))
        return out


def _overlap(a: Units, b: Units | None) -> int:
    if b is None:
        return 0
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def held_units(spec: ModelSpec, train: ParallelLayout, rank: int, layer: int, expert: int) -> Units | None:
    """The units of training expert ``expert`` in ``layer`` that ``rank``'s training shard holds (None: none)."""
    at = train.expert_coordinate(rank)
    per_rank = spec.moe.num_experts // train.ep
    if spec.stage_of_layer(layer, train.pp)[0] != at.pp_rank or expert // per_rank != at.ep_rank:
        return None
    width = spec.moe.expert_ffn_hidden_size // train.etp
    return at.etp_rank * width, (at.etp_rank + 1) * width


def _needed(spec: ModelSpec, layout: ReshardPlan, rank: int) -> list[tuple[int, int, Units]]:
    """(layer, generation expert, units) that ``rank``'s generation shard holds."""
    gen, me = layout.gen, layout.ranks[rank]
    experts, ffn = spec.moe.num_experts, spec.moe.expert_ffn_hidden_size
    layers = spec.layers_of_stage(me.gen_pp_rank, gen.pipeline_parallel)
    tg, g = gen.tensor_parallel, me.gen_tp_rank
    if gen.expert_parallel:
        per_rank = experts // tg
        return [(layer, k, (0, ffn)) for layer in layers for k in range(g * per_rank, (g + 1) * per_rank)]
    width = ffn // tg
    return [(layer, k, (g * width, (g + 1) * width)) for layer in layers for k in range(experts)]


def expert_placement(spec: ModelSpec, layout: ReshardPlan) -> tuple[int, ...]:
    """Generation expert -> training expert, holding the most in place (identity unless generation EP)."""
    experts = spec.moe.num_experts
    gen, train = layout.gen, layout.train
    if not gen.expert_parallel:
        return tuple(range(experts))
    # Experts of one training EP rank are interchangeable, as are the slots of one generation TP rank: solve
    # over blocks of `unit` experts, `unit` dividing both groups' sizes.
    per_train, per_gen = experts // train.ep, experts // gen.tensor_parallel
    unit = gcd(per_train, per_gen)
    blocks = experts // unit
    value = [[0] * blocks for _ in range(blocks)]  # value[slot block][expert block]: units held in place
    for rank in range(train.world_size):
        me = layout.ranks[rank]
        slots = range(me.gen_tp_rank * per_gen // unit, (me.gen_tp_rank + 1) * per_gen // unit)
        for layer in spec.layers_of_stage(me.gen_pp_rank, gen.pipeline_parallel):
            for block in range(blocks):
                held = held_units(spec, train, rank, layer, block * unit)
                if held is not None:
                    for slot_block in slots:
                        value[slot_block][block] += held[1] - held[0]
    chosen = max_value_assignment(value)
    return tuple(chosen[k // unit] * unit + k % unit for k in range(experts))


def linear_bound(spec: ModelSpec, layout: ReshardPlan, rank: int, element_size: int) -> int:
    """``ExpertPlan.bound`` of ``rank`` under the linear placement (generation expert k is training expert k),
    in closed form: the rank's generation box of (layers, experts, FFN units) minus its overlap with its
    training box, with no plan built. Equal to the plan's bound wherever the placement is the identity
    (experts cut across generation TP); under generation EP the plan's placement receives at most this."""
    moe, gen, train = spec.moe, layout.gen, layout.train
    me, at = layout.ranks[rank], train.expert_coordinate(rank)
    tg, g, experts, ffn = gen.tensor_parallel, layout.ranks[rank].gen_tp_rank, moe.num_experts, moe.expert_ffn_hidden_size
    gen_layers = set(spec.layers_of_stage(me.gen_pp_rank, gen.pipeline_parallel))
    if gen.expert_parallel:
        gen_experts, gen_units = (g * experts // tg, (g + 1) * experts // tg), (0, ffn)
    else:
        gen_experts, gen_units = (0, experts), (g * ffn // tg, (g + 1) * ffn // tg)
    per_rank, width = experts // train.ep, ffn // train.etp
    held_experts = (at.ep_rank * per_rank, (at.ep_rank + 1) * per_rank)
    held_units_ = (at.etp_rank * width, (at.etp_rank + 1) * width)
    needed = len(gen_layers) * (gen_experts[1] - gen_experts[0]) * (gen_units[1] - gen_units[0])
    held = (len(gen_layers & set(spec.layers_of_stage(at.pp_rank, train.pp))) * _overlap(gen_experts, held_experts)
            * _overlap(gen_units, held_units_))
    return (needed - held) * EXPERT_UNIT_ROWS * spec.hidden_size * element_size


def check_expert_split(spec: ModelSpec, gen: GenerationLayout) -> None:
    """Refuse a generation layout whose TP size the experts do not split into (whole experts: their count;
    cut experts: their FFN size), naming the sizes that would."""
    if spec.moe is None:
        raise ValueError(f"{spec.architecture} has no routed experts to plan")
    experts, ffn = spec.moe.num_experts, spec.moe.expert_ffn_hidden_size
    tg = gen.tensor_parallel
    if gen.expert_parallel and experts % tg:
        raise ReshardLayoutError(f"generation expert parallelism over tensor_parallel={tg} ranks needs it to divide "
                                 f"the {experts} experts; valid sizes: {divisors(experts)}")
    if not gen.expert_parallel and ffn % tg:
        raise ReshardLayoutError(f"generation tensor_parallel={tg} does not divide the experts' FFN hidden size {ffn}; "
                                 f"valid sizes: {divisors(ffn)}, or whole experts per rank (expert_parallel) for a "
                                 f"size that divides the {experts} experts")


def plan_experts(spec: ModelSpec, train: ParallelLayout, gen: GenerationLayout) -> ExpertPlan:
    """The routed experts' plan from ``train`` to ``gen`` (the dense layout plan gives each rank its generation
    TP and PP rank); refuses a generation layout the experts do not split into."""
    check_expert_split(spec, gen)
    experts, ffn = spec.moe.num_experts, spec.moe.expert_ffn_hidden_size
    layout = plan_reshard(train, gen)
    placement = expert_placement(spec, layout)
    width, per_rank = ffn // train.etp, experts // train.ep
    sent = [0] * train.world_size
    needs = []
    for rank in range(train.world_size):
        mine = []
        for layer, slot, units in _needed(spec, layout, rank):
            expert = placement[slot]
            stage = spec.stage_of_layer(layer, train.pp)[0]
            pieces = []
            for j in range(units[0] // width, -(-units[1] // width)):  # the training ETP slices it spans
                part = (max(units[0], j * width), min(units[1], (j + 1) * width))
                holders = [train.expert_rank_of(j, expert // per_rank, d, stage) for d in range(train.edp)]
                source = rank if rank in holders else min(holders, key=lambda h: (sent[h], h))
                if source != rank:
                    sent[source] += part[1] - part[0]
                pieces.append(ExpertPiece(layer, expert, part, source))
            mine.append(ExpertNeed(layer, slot, expert, units, tuple(pieces)))
        needs.append(tuple(mine))
    return ExpertPlan(spec, layout, placement, tuple(needs))
