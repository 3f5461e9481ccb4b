"""The dense shard (every parameter but the routed experts) as a parameter group: the catalogue's table read as
pieces, so the one planner (``reshard.pieces``) gives its bound and the one executor (``PieceMover``) can move it.

A parameter's units are its geometry's along the dimension TP splits (query groups, FFN rows, vocabulary
rows, input columns), counted over the whole tensor; TP rank j of t holds units [j U / t, (j + 1) U / t) on
every rank of its stage (each data-parallel replica), a replicated tensor its one unit everywhere on it. A
generation rank wants its generation TP slice of each parameter of its generation stage. What it wants and
does not hold is exactly what its micro-DP peers send it in the gather plan, so the bound is the micro-DP
one (``expected_bytes_received``), computed another way: ``tests/test_param_groups.py`` holds the two equal
on every legal pair.

The micro-DP gather (``Resharder``) moves this group with collectives inside each micro-DP group, in buckets,
in place: the dense group's fast path. ``reshard_method: pieces`` moves it point to point by ``PieceMover``
instead, at the same bytes (``tools/bench_reshard.py`` times both). Across pools the cross-pool transfer's
segment routes (point to point, or a chain broadcast down the replicas) are its fast path; the same group,
planned into the generation pool (``plan_dense_across_pools``), receives what its p2p method does.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from hybridengine.model.catalogue import StageParam, stage_params
from hybridengine.model.geometry import ShardGeometry
from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.pieces import Holding, Need, PieceGroup, PiecePlan, Want, plan_pieces
from hybridengine.reshard.plan import GenerationLayout, ReshardPlan

__all__ = ["DenseGroup", "DenseKey", "move_dense", "plan_dense", "plan_dense_across_pools"]


class DenseKey(NamedTuple):
    """A dense parameter: its decoder layer (None outside the layers) and its name there (the full name outside)."""

    layer: int | None
    suffix: str


def _key(param: StageParam) -> DenseKey:
    return DenseKey(param.layer, param.name.split(".", 3)[3] if param.layer is not None else param.name)


def _local(key: DenseKey, layers: range) -> str:
    return key.suffix if key.layer is None else f"decoder.layers.{layers.index(key.layer)}.{key.suffix}"


class DenseGroup(PieceGroup):
    """The dense parameters of ``spec`` from ``train`` to receivers at generation coordinates ``coordinates``
    ((generation TP rank, generation PP rank) each) of ``gen``."""

    kind, label = "dense", "dense"

    def __init__(self, spec: ModelSpec, train: ParallelLayout, gen: GenerationLayout,
                 coordinates: Sequence[tuple[int, int]]) -> None:
        self.spec, self.train, self.gen, self.coordinates = spec, train, gen, tuple(coordinates)
        self.whole: dict[DenseKey, StageParam] = {}  # each parameter at TP 1, from the stage that holds it
        self.stage: dict[DenseKey, int] = {}
        for pp in range(train.pp):
            for param in stage_params(spec, 1, train.pp, pp, routed=False):
                self.whole.setdefault(_key(param), param)
                self.stage.setdefault(_key(param), pp)
        self._wants = {}
        for g, pp in set(self.coordinates):
            self._wants[g, pp] = [_key(p) for p in stage_params(spec, 1, gen.pipeline_parallel, pp, routed=False)]

    def _units(self, key: DenseKey) -> int:
        param = self.whole[key]
        return 1 if param.geometry.replicated else param.geometry.units(param.shape)

    def wants(self, receiver: int) -> list[Want]:
        g, pp = self.coordinates[receiver]
        out = []
        for key in self._wants[g, pp]:
            units, tg = self._units(key), self.gen.tensor_parallel
            span = (0, 1) if self.whole[key].geometry.replicated else (g * units // tg, (g + 1) * units // tg)
            out.append(Want(key, key, span))
        return out

    def holdings(self, key: DenseKey) -> list[Holding]:
        train, stage = self.train, self.stage[key]
        if self.whole[key].geometry.replicated:
            return [Holding((0, 1), tuple(train.rank_of(t, stage, d) for d in range(train.dp) for t in range(train.tp)))]
        width = self._units(key) // train.tp
        return [Holding((t * width, (t + 1) * width), tuple(train.rank_of(t, stage, d) for d in range(train.dp)))
                for t in range(train.tp)]

    def geometries(self, key: DenseKey) -> tuple[ShardGeometry, ...]:
        return (self.whole[key].geometry,)

    def shapes(self, key: DenseKey, units: int) -> tuple[tuple[int, ...], ...]:
        param = self.whole[key]
        if param.geometry.replicated:
            return (param.shape,)
        shape = list(param.shape)
        shape[param.geometry.dim] = units * param.geometry.unit_size
        return (tuple(shape),)

    def training_names(self, train_rank: int, key: DenseKey) -> tuple[str, ...]:
        stage = self.train.coordinate(train_rank).pp_rank
        return (_local(key, self.spec.layers_of_stage(stage, self.train.pp)),)

    def generation_names(self, receiver: int, need: Need) -> tuple[str, ...]:
        _, pp = self.coordinates[receiver]
        return (_local(need.key, self.spec.layers_of_stage(pp, self.gen.pipeline_parallel)),)


def plan_dense(spec: ModelSpec, layout: ReshardPlan) -> PiecePlan:
    """The dense group's piece plan over the layout plan's ranks, colocated."""
    coordinates = [(me.gen_tp_rank, me.gen_pp_rank) for me in layout.ranks]
    group = DenseGroup(spec, layout.train, layout.gen, coordinates)
    return plan_pieces(group, layout.train.world_size, colocated=True)


def plan_dense_across_pools(spec: ModelSpec, plan) -> PiecePlan:
    """The dense group's piece plan into a generation pool of its own (``cross_pool.plan.CrossPoolPlan``): every
    generation rank receives its whole shard (it holds nothing), each piece from its least loaded holder, as
    the cross-pool plan's p2p method receives it."""
    coordinates = [(c.tp_rank, c.pp_rank) for c in map(plan.gen_coordinate, range(plan.gen_world_size))]
    group = DenseGroup(spec, plan.train, plan.gen, coordinates)
    return plan_pieces(group, plan.gen_world_size, colocated=False)


def move_dense(plan, rank: int, params: dict, transport) -> dict:
    """``reshard_method: pieces``: the dense shard of ``plan`` (a ``WeightPlan``) moved point to point by the one
    executor, each rank receiving what it wants and does not hold from its least loaded holder; ``params``:
    this rank's dense training parameters. The micro-DP gather's bytes, or fewer."""
    from hybridengine.reshard.piece_mover import PieceMover

    return PieceMover.colocated(plan.dense, rank, transport).move(params)
