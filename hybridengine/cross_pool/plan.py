"""The 3D-HybridEngine's planner across pools: the actor's training ranks -> a generation pool of its own.

Pure: every rank of both pools computes the same plan from (training layout,
generation TP/PP, number of generation replicas) and keeps its own part.

The training pool holds ``d`` replicas of the model, each split t x p. The
generation pool holds ``d_g`` replicas split t_g x p_g, its ranks numbered as
megatron numbers a grid (generation TP fastest, then replica, then stage):

    gen rank = gen_tp + t_g * (gen_dp + d_g * gen_pp)

A generation shard (gen_tp, gen_pp) is made of *segments*, each a part of one
training shard, exactly as in the colocated plan (``reshard_plan``): the
r_t x r_p training shards it joins (t_g divides t, p_g divides p), or the
j-th of k slices of one training shard (t_g = k t, p = p_g = 1). Every
generation rank receives exactly its shard, M / (t_g p_g) bytes, the minimum,
and no rank ever holds more than its own shard: a training rank sends parts of
its training shard, a generation rank holds its generation shard.

Each segment must reach the d_g generation ranks of its shard's replica group
(the generation ranks with the same (gen_tp, gen_pp)). Two ways, and the plan
takes the one that moves fewer bytes over the busiest link (every link the
same speed, so the busiest is the slowest; ties go to point-to-point, which
moves fewer bytes in all and has no relay latency):

* ``p2p``: every generation rank receives each segment straight from one of the
  d training ranks that hold it (replica ``(j d_g + gen_dp) % d`` for the j-th
  segment), so the d holders of a part share its d_g sends to within one.
* ``broadcast``: each segment leaves the training pool once, into one rank of
  the replica group, and is relayed down a chain through the others (a
  pipelined chain broadcast, bucket by bucket, on any backend). A training rank
  sends its part at most once; a generation rank forwards what it received,
  except the chain's last. The j-th segment (counted over all shards) enters
  at replica ``j % d_g`` and is sent by training replica ``j % d``, so the
  relaying and the sending spread evenly.

p2p wins when d_g / d is small against the r_t r_p segments a shard is made
of (each generation rank's inbound link, M / (t_g p_g), is the floor either
way); broadcast wins with many generation replicas fed by few training ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import MeshCoordinate, ParallelLayout, divisors
from hybridengine.reshard.plan import (
    GenerationLayout,
    RankPlan,
    ReshardLayoutError,
    ReshardPlan,
    plan_reshard,
)
from hybridengine.reshard.weight_plan import (
    GenParamSource,
    WeightPlan,
    bucket_blocks,
    bucket_sources,
)

__all__ = [
    "CROSS_POOL_METHODS", "Bucket", "CrossPoolPlan", "LinkBytes", "Route", "Segment", "cross_pool_generation_layouts",
    "plan_cross_pool", "plan_for_model", "segment_bytes", "shard_buckets",
]

CROSS_POOL_METHODS = ("auto", "p2p", "broadcast")


@dataclass(frozen=True)
class Segment:
    """Part ``slice_index`` of ``slices`` of the training shard at (train_tp, train_pp); 1 slice: all of it."""

    train_tp: int
    train_pp: int
    slice_index: int = 0
    slices: int = 1


@dataclass(frozen=True)
class Route:
    """Segment ``position`` of generation shard (gen_tp, gen_pp): from training rank ``src`` down ``chain``.

    ``chain[0]`` receives it from ``src``; under broadcast each later member receives it from the one
    before. p2p routes have a chain of one. Ranks are pool-local (training ranks, generation ranks).
    """

    src: int
    chain: tuple[int, ...]
    gen_tp: int
    gen_pp: int
    position: int


@dataclass(frozen=True)
class LinkBytes:
    """Bytes each rank sends and receives under a plan, by pool."""

    train_sent: tuple[int, ...]
    train_received: tuple[int, ...]
    gen_sent: tuple[int, ...]
    gen_received: tuple[int, ...]

    @property
    def busiest(self) -> int:
        """The most bytes any one link carries in one direction: what the slowest link must move."""
        return max(*self.train_sent, *self.train_received, *self.gen_sent, *self.gen_received)

    @property
    def total(self) -> int:
        return sum(self.gen_received)


def cross_pool_generation_layouts(train: ParallelLayout, max_tp: int = 8) -> list[GenerationLayout]:
    """Every generation (TP, PP) a separate pool can take from ``train`` (any number of replicas each):
    joins (t_g divides t, p_g divides p) first, then slices (t_g = k t up to ``max_tp``, PP 1)."""
    gather = [GenerationLayout(tg, pg) for pg in divisors(train.pp) for tg in divisors(train.tp)]
    sliced = [GenerationLayout(train.tp * k, 1) for k in range(2, max_tp // train.tp + 1)] if train.pp == 1 else []
    return gather + sliced


def _slices(train: ParallelLayout, gen: GenerationLayout | None) -> int | None:
    """k when ``gen`` slices the training shards (t_g = k t), None when it joins them."""
    if gen is None or gen.tensor_parallel <= train.tp:
        return None
    return gen.tensor_parallel // train.tp


@dataclass(frozen=True)
class CrossPoolPlan:
    train: ParallelLayout
    gen: GenerationLayout
    gen_dp: int
    method: str  # "p2p" or "broadcast"
    reason: str  # why this method: the busiest-link bytes of both, in segment units
    segments: tuple[tuple[Segment, ...], ...]  # per generation shard, indexed gen_pp * t_g + gen_tp
    routes: tuple[Route, ...]

    @property
    def gen_world_size(self) -> int:
        return self.gen.tensor_parallel * self.gen.pipeline_parallel * self.gen_dp

    @property
    def gen_layout(self) -> ParallelLayout:
        """The generation pool as a grid (generation TP x PP x replicas), in megatron's rank order."""
        return ParallelLayout(self.gen.tensor_parallel, self.gen.pipeline_parallel, self.gen_dp)

    def gen_coordinate(self, gen_rank: int) -> MeshCoordinate:
        return self.gen_layout.coordinate(gen_rank)

    def shard_segments(self, gen_tp: int, gen_pp: int) -> tuple[Segment, ...]:
        return self.segments[gen_pp * self.gen.tensor_parallel + gen_tp]

    @cached_property
    def colocated(self) -> ReshardPlan:
        """The colocated plan of one training replica (k replicas for a slice pair): the segments' order and
        each generation parameter's pieces come from it (``hybridengine.cross_pool.transfer``)."""
        return plan_reshard(ParallelLayout(self.train.tp, self.train.pp, _slices(self.train, self.gen) or 1), self.gen)

    def colocated_rank(self, gen_tp: int, gen_pp: int) -> int:
        """A rank of ``colocated`` whose generation shard is (gen_tp, gen_pp)."""
        return next(r.rank for r in self.colocated.ranks if (r.gen_tp_rank, r.gen_pp_rank) == (gen_tp, gen_pp))

    def routes_from(self, train_rank: int) -> list[Route]:
        return [r for r in self.routes if r.src == train_rank]

    def routes_into(self, gen_rank: int) -> list[Route]:
        """The routes whose chain passes through ``gen_rank``, in plan order."""
        return [r for r in self.routes if gen_rank in r.chain]

    def link_bytes(self, segment_bytes: Callable[[int, int, int], int]) -> LinkBytes:
        """Per-rank bytes, with ``segment_bytes(gen_tp, gen_pp, position)`` the size of one segment."""
        train_sent = [0] * self.train.world_size
        gen_sent, gen_received = [0] * self.gen_world_size, [0] * self.gen_world_size
        for route in self.routes:
            size = segment_bytes(route.gen_tp, route.gen_pp, route.position)
            train_sent[route.src] += size
            for i, rank in enumerate(route.chain):
                gen_received[rank] += size
                if i + 1 < len(route.chain):
                    gen_sent[rank] += size
        return LinkBytes(tuple(train_sent), (0,) * self.train.world_size, tuple(gen_sent), tuple(gen_received))

    def lower_bound(self, model_bytes: int) -> int:
        """M / (t_g p_g): what each generation rank must receive, at least."""
        return model_bytes // (self.gen.tensor_parallel * self.gen.pipeline_parallel)


def _check(train: ParallelLayout, gen: GenerationLayout, gen_dp: int) -> None:
    if not isinstance(gen_dp, int) or gen_dp < 1:
        raise ReshardLayoutError(f"a generation pool needs at least one replica, got gen_dp={gen_dp!r}")
    sizes = {(g.tensor_parallel, g.pipeline_parallel) for g in cross_pool_generation_layouts(train, max(gen.tensor_parallel, 8))}
    if (gen.tensor_parallel, gen.pipeline_parallel) not in sizes:  # whole experts or cut: the dense split alike
        legal = ", ".join(f"(tp={g.tensor_parallel}, pp={g.pipeline_parallel})" for g in cross_pool_generation_layouts(train))
        raise ReshardLayoutError(
            f"generation tensor_parallel={gen.tensor_parallel}, pipeline_parallel={gen.pipeline_parallel} cannot be "
            f"fed from training {train}: generation TP must divide training TP or, with pipeline_parallel 1 on both "
            f"sides, be a multiple of it; generation PP must divide training PP; legal generation sizes: {legal}"
        )


def _segments(plan: ReshardPlan, me: RankPlan) -> tuple[Segment, ...]:
    if plan.kind == "slice":
        (tp, pp), = me.source_shards
        return (Segment(tp, pp, me.slice_index, me.slices),)
    return tuple(Segment(tp, pp) for tp, pp in me.source_shards)


def _routes(train: ParallelLayout, gen_layout: ParallelLayout, segments, method: str) -> list[Route]:
    """Routes in a fixed order (stage, TP rank, segment); ``j`` counts segments over all shards, so the
    training replica that sends, and the replica a chain starts at, rotate evenly."""
    tg, pg, dg, d = gen_layout.tp, gen_layout.pp, gen_layout.dp, train.dp
    routes, j = [], 0
    for gpp in range(pg):
        for gtp in range(tg):
            replicas = [gen_layout.rank_of(gtp, gpp, r) for r in range(dg)]
            for i, seg in enumerate(segments[gpp * tg + gtp]):
                if method == "p2p":
                    for r, rank in enumerate(replicas):
                        src = train.rank_of(seg.train_tp, seg.train_pp, (j * dg + r) % d)
                        routes.append(Route(src, (rank,), gtp, gpp, i))
                else:
                    chain = tuple(replicas[(j + m) % dg] for m in range(dg))
                    routes.append(Route(train.rank_of(seg.train_tp, seg.train_pp, j % d), chain, gtp, gpp, i))
                j += 1
    return routes


def plan_cross_pool(train: ParallelLayout, gen: GenerationLayout, gen_dp: int, method: str = "auto",
                    segment_bytes: Callable[[int, int, int], int] | None = None) -> CrossPoolPlan:
    """The transfer from ``train``'s pool to a pool of ``gen_dp`` generation replicas at ``gen``.

    ``method`` "auto" compares both methods' busiest link under ``segment_bytes(gen_tp, gen_pp, position)``
    (default: every segment 1 unit; they are all the same size up to the replicated norms).
    """
    if method not in CROSS_POOL_METHODS:
        raise ValueError(f"cross-pool method {method!r} is not one of {CROSS_POOL_METHODS}")
    _check(train, gen, gen_dp)
    k = _slices(train, gen) or 1
    colocated = plan_reshard(ParallelLayout(train.tp, train.pp, k), gen)
    gen_layout = ParallelLayout(gen.tensor_parallel, gen.pipeline_parallel, gen_dp)
    segments: list[tuple[Segment, ...]] = []
    for gpp in range(gen.pipeline_parallel):
        for gtp in range(gen.tensor_parallel):
            me = next(r for r in colocated.ranks if (r.gen_tp_rank, r.gen_pp_rank) == (gtp, gpp))
            segments.append(_segments(colocated, me))
    if segment_bytes is None:
        def segment_bytes(gtp, gpp, i):
            return 1  # within one plan every segment is a whole training shard, or every one a 1/k slice
    candidates = {}
    for name in ("p2p", "broadcast"):
        plan = CrossPoolPlan(train, gen, gen_dp, name, "", tuple(segments),
                             tuple(_routes(train, gen_layout, segments, name)))
        candidates[name] = (plan.link_bytes(segment_bytes).busiest, plan)
    if method == "auto":
        method = "p2p" if candidates["p2p"][0] <= candidates["broadcast"][0] else "broadcast"
    reason = (f"busiest link: p2p {candidates['p2p'][0]}, broadcast {candidates['broadcast'][0]} "
              f"(units of segment_bytes); {method} chosen")
    chosen = candidates[method][1]
    return CrossPoolPlan(train, gen, gen_dp, method, reason, chosen.segments, chosen.routes)


# ---------------------------------------------------------------- for one model

def _shard_sources(spec: ModelSpec, plan: CrossPoolPlan, gen_tp: int, gen_pp: int) -> list[GenParamSource]:
    """Generation shard (gen_tp, gen_pp)'s parameters and their pieces, as the colocated plan joins them (a
    mixture of experts' dense part: its routed experts travel as their group's pieces, ``reshard.expert_group``)."""
    return WeightPlan(spec, plan.colocated).sources(plan.colocated_rank(gen_tp, gen_pp))


def _piece_shape(source: GenParamSource, index: int, slices: int) -> tuple[int, ...]:
    """The shape of member ``index``'s piece of ``source``: its training shard, or (sliced) the generation shape."""
    return tuple(source.param.shape) if slices > 1 else tuple(source.train_shapes[index])


def _segment_sizes(sources: Sequence[GenParamSource], segments: int, slices: int) -> tuple[int, ...]:
    """Elements each segment (micro-DP member) contributes to ``sources``."""
    sizes = [0] * segments
    for s in sources:
        for i, m in enumerate(s.members):
            sizes[m] += math.prod(_piece_shape(s, i, slices))
    return tuple(sizes)


def segment_bytes(spec: ModelSpec, plan: CrossPoolPlan, element_size: int):
    """``(gen_tp, gen_pp, position) -> bytes`` of one segment for ``spec`` (replicated norms travel once)."""
    cache: dict[tuple[int, int], list[int]] = {}

    def size(gen_tp: int, gen_pp: int, position: int) -> int:
        if (gen_tp, gen_pp) not in cache:
            segments = plan.shard_segments(gen_tp, gen_pp)
            cache[(gen_tp, gen_pp)] = _segment_sizes(_shard_sources(spec, plan, gen_tp, gen_pp), len(segments),
                                                     segments[0].slices)
        return cache[(gen_tp, gen_pp)][position] * element_size

    return size


def plan_for_model(spec: ModelSpec, train: ParallelLayout, gen: GenerationLayout, gen_dp: int,
                   element_size: int, method: str = "auto") -> CrossPoolPlan:
    """``plan_cross_pool`` deciding between the methods on ``spec``'s exact segment sizes."""
    rough = plan_cross_pool(train, gen, gen_dp, "p2p")
    return plan_cross_pool(train, gen, gen_dp, method, segment_bytes(spec, rough, element_size))


@dataclass(frozen=True)
class Bucket:
    sources: tuple[GenParamSource, ...]
    sizes: tuple[int, ...]  # elements of each segment's message
    blocks: tuple  # the copies that lay the segments' messages into the flat generation buffer


def shard_buckets(spec: ModelSpec, plan: CrossPoolPlan, gen_tp: int, gen_pp: int, element_size: int,
                  bucket_bytes: int) -> list[Bucket]:
    """Generation shard (gen_tp, gen_pp)'s parameters in buckets of about ``bucket_bytes``: per bucket, what
    each segment's message holds and how the messages are laid into the flat generation buffer (each
    parameter a view of it, in the generation stage's order)."""
    segments = plan.shard_segments(gen_tp, gen_pp)
    buckets = bucket_sources(_shard_sources(spec, plan, gen_tp, gen_pp), element_size, bucket_bytes)
    slices = segments[0].slices
    offsets, offset = {}, 0  # where each generation parameter starts in the flat buffer
    for s in (s for b in buckets for s in b):
        offsets[s.param.name] = offset
        offset += s.param.numel
    # A slice is already the generation shard: one piece, copied whole.
    return [Bucket(tuple(b), _segment_sizes(b, len(segments), slices),
                   tuple(bucket_blocks(b, offsets, len(segments), lambda source, i: _piece_shape(source, i, slices))))
            for b in buckets]
