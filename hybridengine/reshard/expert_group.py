"""A mixture of experts' routed experts as a parameter group of the weight plan: where training holds them,
where generation wants them, and where each generation expert is placed.

Everything about an expert lies along its FFN units: unit u is row u of the gate and of the up projection
(fc1, the catalogue's ``FC1`` geometry) and column u of the down projection (fc2, ``COLUMNS``), 3 x hidden
elements. Training holds, for each layer of a stage and each expert of an EP rank, the units of its ETP
slice, on every expert-DP copy. A generation rank wants, for each layer of its generation stage,

- every expert's units of its generation TP slice (experts cut across generation TP), or
- all units of the experts placed on it (whole experts, ``GenerationLayout.expert_parallel``).

The planner (``reshard.pieces``) does the rest, the same for experts as for any group: a receiver gets what
it wants and does not hold, so the bytes received are the bound

    bytes(r) = sum over (layer, expert) it wants of |wanted units \\ held units| x 3 x hidden x element size

Colocated, under expert parallelism in generation the placement is free: generation expert k may be any
training expert, if the router's rows move with it. ``expert_placement`` is the one that maximizes what
the ranks hold in total (an assignment problem over blocks of interchangeable experts), and vLLM's linear
placement where that is as good. Across pools nothing is held, so the placement is linear.
"""

from __future__ import annotations

from math import gcd
from typing import NamedTuple, Sequence

from hybridengine.model.catalogue import EXPERT_ENTRIES
from hybridengine.model.geometry import ShardGeometry
from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout, divisors
from hybridengine.reshard.assignment import max_value_assignment
from hybridengine.reshard.pieces import Holding, Need, PieceGroup, PiecePlan, Want, overlap, plan_pieces
from hybridengine.reshard.plan import GenerationLayout, ReshardLayoutError, ReshardPlan, plan_reshard

__all__ = ["EXPERT_UNIT_ROWS", "ExpertGroup", "ExpertKey", "ExpertPlan", "check_expert_split", "expert_placement",
           "held_units", "linear_bound", "plan_cross_pool_experts", "plan_experts"]

EXPERT_UNIT_ROWS = 3  # per FFN unit: a gate row, an up row, a down column, each of hidden size

Units = tuple[int, int]


class ExpertKey(NamedTuple):
    """Training (HF) expert ``expert`` of model layer ``layer``."""

    layer: int
    expert: int


class ExpertGroup(PieceGroup):
    """The routed experts of ``spec`` from training layout ``train`` to receivers at generation coordinates
    ``coordinates`` ((generation TP rank, generation PP rank) each) of ``gen``, generation expert k being
    training expert ``placement[k]``."""

    kind, label = "experts", "expert"

    def __init__(self, spec: ModelSpec, train: ParallelLayout, gen: GenerationLayout,
                 coordinates: Sequence[tuple[int, int]], placement: Sequence[int]) -> None:
        self.spec, self.train, self.gen = spec, train, gen
        self.coordinates, self.placement = tuple(coordinates), tuple(placement)
        self._geometries = tuple(entry.geometry(spec) for entry in EXPERT_ENTRIES)
        self._whole = tuple(entry.shape(spec, 1) for entry in EXPERT_ENTRIES)
        self.per_rank = spec.moe.num_experts // train.ep
        self.width = spec.moe.expert_ffn_hidden_size // train.etp

    def wants(self, receiver: int) -> list[Want]:
        gen, (g, pp_rank) = self.gen, self.coordinates[receiver]
        experts, ffn, tg = self.spec.moe.num_experts, self.spec.moe.expert_ffn_hidden_size, gen.tensor_parallel
        layers = self.spec.layers_of_stage(pp_rank, gen.pipeline_parallel)
        if gen.expert_parallel:
            slots, units = range(g * experts // tg, (g + 1) * experts // tg), (0, ffn)
        else:
            slots, units = range(experts), (g * ffn // tg, (g + 1) * ffn // tg)
        return [Want(k, ExpertKey(layer, self.placement[k]), units) for layer in layers for k in slots]

    def holdings(self, key: ExpertKey) -> list[Holding]:
        train, w = self.train, self.width
        stage = self.spec.stage_of_layer(key.layer, train.pp)[0]
        return [Holding((j * w, (j + 1) * w),
                        tuple(train.expert_rank_of(j, key.expert // self.per_rank, d, stage) for d in range(train.edp)))
                for j in range(train.etp)]

    def together(self, key: ExpertKey) -> int:
        return key.layer  # an engine stacks a layer's experts into one tensor (vLLM's w13, w2)

    def geometries(self, key: ExpertKey) -> tuple[ShardGeometry, ...]:
        return self._geometries

    def shapes(self, key: ExpertKey, units: int) -> tuple[tuple[int, ...], ...]:
        out = []
        for geometry, whole in zip(self._geometries, self._whole):
            shape = list(whole)
            shape[geometry.dim] = units * geometry.unit_size
            out.append(tuple(shape))
        return tuple(out)

    def training_names(self, train_rank: int, key: ExpertKey) -> tuple[str, ...]:
        at = self.train.expert_coordinate(train_rank)
        local_layer = self.spec.layers_of_stage(at.pp_rank, self.train.pp).index(key.layer)
        local = key.expert - at.ep_rank * self.per_rank
        return tuple(f"decoder.layers.{local_layer}.{entry.suffix.format(expert=local)}" for entry in EXPERT_ENTRIES)

    def generation_names(self, receiver: int, need: Need) -> tuple[str, ...]:
        """The generation stage's megatron names: the catalogue's at ``ExpertShard(ep=t_g, ep_rank=g, etp=1)``
        (whole experts) or ``ExpertShard(etp=t_g)`` (cut experts)."""
        gen, (g, pp_rank) = self.gen, self.coordinates[receiver]
        local_layer = self.spec.layers_of_stage(pp_rank, gen.pipeline_parallel).index(need.key.layer)
        local = need.slot - g * self.spec.moe.num_experts // gen.tensor_parallel if gen.expert_parallel else need.slot
        return tuple(f"decoder.layers.{local_layer}.{entry.suffix.format(expert=local)}" for entry in EXPERT_ENTRIES)


class ExpertPlan(PiecePlan):
    """The experts' piece plan, with what the engines read of it: the placement and the layout it follows."""

    layout: ReshardPlan  # colocated: the dense layout plan; across pools: the cross-pool plan

    def __init__(self, plan: PiecePlan, layout) -> None:
        super().__init__(plan.group, plan.needs, plan.colocated)
        object.__setattr__(self, "layout", layout)

    @property
    def spec(self) -> ModelSpec:
        return self.group.spec

    @property
    def placement(self) -> tuple[int, ...]:
        return self.group.placement

    @property
    def train(self) -> ParallelLayout:
        return self.group.train

    @property
    def gen(self) -> GenerationLayout:
        return self.group.gen


def held_units(spec: ModelSpec, train: ParallelLayout, rank: int, layer: int, expert: int) -> Units | None:
    """The units of training expert ``expert`` in ``layer`` that ``rank``'s training shard holds (None: none)."""
    at = train.expert_coordinate(rank)
    per_rank = spec.moe.num_experts // train.ep
    if spec.stage_of_layer(layer, train.pp)[0] != at.pp_rank or expert // per_rank != at.ep_rank:
        return None
    width = spec.moe.expert_ffn_hidden_size // train.etp
    return at.etp_rank * width, (at.etp_rank + 1) * width


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
    held = (len(gen_layers & set(spec.layers_of_stage(at.pp_rank, train.pp))) * overlap(gen_experts, held_experts)
            * overlap(gen_units, held_units_))
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
    """The routed experts' plan from ``train`` to ``gen``, colocated (the dense layout plan gives each rank its
    generation TP and PP rank); refuses a generation layout the experts do not split into."""
    check_expert_split(spec, gen)
    layout = plan_reshard(train, gen)
    coordinates = [(me.gen_tp_rank, me.gen_pp_rank) for me in layout.ranks]
    group = ExpertGroup(spec, train, gen, coordinates, expert_placement(spec, layout))
    return ExpertPlan(plan_pieces(group, train.world_size, colocated=True), layout)


def plan_cross_pool_experts(spec: ModelSpec, plan) -> ExpertPlan:
    """The routed experts' part of a cross-pool ``plan`` (``cross_pool.plan.CrossPoolPlan``): every generation
    rank receives all of its generation experts (it holds nothing), linearly placed."""
    if spec.moe is None:
        raise ValueError(f"{spec.architecture} has no routed experts to plan")
    check_expert_split(spec, plan.gen)
    coordinates = [(c.tp_rank, c.pp_rank) for c in map(plan.gen_coordinate, range(plan.gen_world_size))]
    group = ExpertGroup(spec, plan.train, plan.gen, coordinates, range(spec.moe.num_experts))
    return ExpertPlan(plan_pieces(group, plan.gen_world_size, colocated=False), plan)
