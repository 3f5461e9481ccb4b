"""The 3D-HybridEngine's planner: training layout -> generation groups (HybridFlow §5).

Pure: every rank computes the same plan from (training layout, generation
TP/PP sizes) and keeps its own part; no process group is involved.

Training is p-t-d (megatron rank order: TP fastest, then DP, then PP).
Generation is p_g-t_g-d_g-d. Two kinds of pairs are legal:

* gather: t_g divides t and p_g divides p. A generation shard is the block of
  r_t = t/t_g consecutive TP shards times r_p = p/p_g consecutive stages of one
  training replica; the d_g = r_t * r_p ranks holding that block form a
  micro-DP group and all-gather it, after which each of them serves as one
  generation replica. Generation TP (PP) groups take ranks at stride r_t (r_p).
* slice: t_g = k * t with p_g = p = 1 and k dividing d. A generation shard is
  the j-th of k slices of one training TP shard, so each rank keeps a slice of
  what it already holds and nothing moves; a generation TP group spans k
  training replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from functools import cached_property

from hybridengine.parallel.layout import MeshCoordinate, ParallelLayout, divisors

__all__ = [
    "GenerationLayout", "GenerationMesh", "ReshardLayoutError", "RankPlan", "ReshardPlan", "legal_generation_layouts",
    "plan_reshard",
]


class ReshardLayoutError(ValueError):
    """The generation layout cannot be reached from the training layout."""


@dataclass(frozen=True)
class GenerationLayout:
    """A generation engine's grid: TP x PP, and how a mixture of experts' routed experts split over the TP
    ranks: each expert cut across them (False, vLLM's default), or whole experts per rank
    (``expert_parallel``, vLLM's ``enable_expert_parallel``: EP size = the TP size)."""

    tensor_parallel: int
    pipeline_parallel: int = 1
    expert_parallel: bool = False

    def __str__(self) -> str:
        return f"genTP{self.tensor_parallel}xPP{self.pipeline_parallel}" + ("xEP" if self.expert_parallel else "")


def legal_generation_layouts(train: ParallelLayout) -> list[GenerationLayout]:
    """Every generation (TP, PP) reachable from ``train``, gather pairs first."""
    legal = [GenerationLayout(tg, pg) for pg in divisors(train.pp) for tg in divisors(train.tp)]
    if train.pp == 1:
        legal += [GenerationLayout(train.tp * k, 1) for k in divisors(train.dp) if k > 1]
    return legal


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of the plan."""

    rank: int
    gen_tp_rank: int
    gen_pp_rank: int
    gen_dp_rank: int
    micro_dp_group: tuple[int, ...]  # ranks whose training shards form this rank's generation shard, in buffer order
    micro_dp_index: int  # position of this rank's own training shard in that order
    source_shards: tuple[tuple[int, int], ...]  # (tp_rank, pp_rank) of each member's training shard
    slice_index: int = 0  # slice kind: which of ``slices`` parts of the own training shard is kept
    slices: int = 1


@dataclass(frozen=True)
class ReshardPlan:
    train: ParallelLayout
    gen: GenerationLayout
    kind: str  # "gather" or "slice"
    gen_tp_groups: tuple[tuple[int, ...], ...]
    gen_pp_groups: tuple[tuple[int, ...], ...]
    micro_dp_groups: tuple[tuple[int, ...], ...]
    ranks: tuple[RankPlan, ...]

    @property
    def micro_dp_size(self) -> int:
        return len(self.micro_dp_groups[0])

    @property
    def gen_dp(self) -> int:
        return self.train.world_size // (self.gen.tensor_parallel * self.gen.pipeline_parallel)

    def bytes_received(self, rank: int, shard_bytes: Callable[[int, int], int]) -> int:
        """Bytes ``rank`` must receive: its micro-DP peers' training shards, nothing else.

        ``shard_bytes(tp_rank, pp_rank)`` is the size of one training shard.
        Averaged over ranks this is the paper's lower bound (d_g - 1) * M / (t * p).
        """
        plan = self.ranks[rank]
        return sum(
            shard_bytes(*src) for member, src in zip(plan.micro_dp_group, plan.source_shards) if member != rank
        )


def _check(train: ParallelLayout, gen: GenerationLayout) -> str:
    tg, pg = gen.tensor_parallel, gen.pipeline_parallel
    if tg >= 1 and pg >= 1 and train.tp % tg == 0 and train.pp % pg == 0:
        return "gather"
    if pg == 1 and train.pp == 1 and tg % train.tp == 0 and train.dp % (tg // train.tp) == 0:
        return "slice"
    legal = ", ".join(f"(tp={g.tensor_parallel}, pp={g.pipeline_parallel})" for g in legal_generation_layouts(train))
    raise ReshardLayoutError(
        f"generation tensor_parallel={tg}, pipeline_parallel={pg} cannot be reached from training {train}: "
        f"generation TP must divide training TP (or be a multiple of it that divides TP*DP, with PP 1) and "
        f"generation PP must divide training PP; legal generation sizes: {legal}"
    )


def plan_reshard(train: ParallelLayout, gen: GenerationLayout) -> ReshardPlan:
    train = train.weights  # context-parallel ranks are data-parallel ranks to the weights
    kind = _check(train, gen)
    return _plan_gather(train, gen) if kind == "gather" else _plan_slice(train, gen)


def _plan_gather(train: ParallelLayout, gen: GenerationLayout) -> ReshardPlan:
    t, p, d = train.tp, train.pp, train.dp
    tg, pg = gen.tensor_parallel, gen.pipeline_parallel
    rt, rp = t // tg, p // pg
    d_g = rt * rp

    def member(dd: int, gtp: int, gpp: int, m: int) -> int:
        """Rank at micro-DP position m of generation shard (gtp, gpp) in training replica dd."""
        return train.rank_of(gtp * rt + m % rt, gpp * rp + m // rt, dd)

    ranks: dict[int, RankPlan] = {}
    micro_dp, gen_tp_groups, gen_pp_groups = [], [], []
    for dd in range(d):
        for gpp in range(pg):
            for m in range(d_g):
                gen_tp_groups.append(tuple(member(dd, gtp, gpp, m) for gtp in range(tg)))
        for gtp in range(tg):
            for m in range(d_g):
                gen_pp_groups.append(tuple(member(dd, gtp, gpp, m) for gpp in range(pg)))
        for gpp in range(pg):
            for gtp in range(tg):
                group = tuple(member(dd, gtp, gpp, m) for m in range(d_g))
                micro_dp.append(group)
                sources = tuple((train.coordinate(r).tp_rank, train.coordinate(r).pp_rank) for r in group)
                for m, rank in enumerate(group):
                    ranks[rank] = RankPlan(
                        rank=rank, gen_tp_rank=gtp, gen_pp_rank=gpp, gen_dp_rank=dd * d_g + m,
                        micro_dp_group=group, micro_dp_index=m, source_shards=sources,
                    )
    return ReshardPlan(
        train, gen, "gather", tuple(sorted(gen_tp_groups)), tuple(sorted(gen_pp_groups)), tuple(sorted(micro_dp)),
        tuple(ranks[r] for r in range(train.world_size)),
    )


def _plan_slice(train: ParallelLayout, gen: GenerationLayout) -> ReshardPlan:
    t, d = train.tp, train.dp
    tg = gen.tensor_parallel
    k = tg // t
    ranks: dict[int, RankPlan] = {}
    gen_tp_groups = []
    for e in range(d // k):
        group = tuple(train.rank_of(g // k, 0, e * k + g % k) for g in range(tg))
        gen_tp_groups.append(group)
        for g, rank in enumerate(group):
            ranks[rank] = RankPlan(
                rank=rank, gen_tp_rank=g, gen_pp_rank=0, gen_dp_rank=e, micro_dp_group=(rank,), micro_dp_index=0,
                source_shards=((g // k, 0),), slice_index=g % k, slices=k,
            )
    return ReshardPlan(
        train, gen, "slice", tuple(gen_tp_groups), tuple((r,) for r in range(train.world_size)),
        tuple((r,) for r in range(train.world_size)), tuple(ranks[r] for r in range(train.world_size)),
    )


@dataclass(frozen=True)
class GenerationMesh:
    """The generation layout as a data mesh: which ranks form one generation replica.

    It answers what dispatch asks of a ``ParallelLayout`` (``world_size``,
    ``data_replicas``, ``data_rank``, ``is_collect_rank``) for the generation grid:
    ``dp`` counts all generation replicas (d * d_g), every rank of a replica
    gets the same prompts, and its generation TP rank 0 on the last
    generation stage answers.
    """

    train: ParallelLayout
    gen: GenerationLayout

    @cached_property
    def plan(self) -> ReshardPlan:
        return plan_reshard(self.train, self.gen)

    @property
    def world_size(self) -> int:
        return self.train.world_size

    @property
    def dp(self) -> int:
        return self.plan.gen_dp

    @property
    def data_replicas(self) -> int:
        """The replicas that take prompts of their own: every generation replica."""
        return self.dp

    def coordinate(self, rank: int) -> MeshCoordinate:
        me = self.plan.ranks[rank]
        return MeshCoordinate(tp_rank=me.gen_tp_rank, pp_rank=me.gen_pp_rank, dp_rank=me.gen_dp_rank)

    def data_rank(self, rank: int) -> int:
        return self.plan.ranks[rank].gen_dp_rank

    def is_collect_rank(self, rank: int) -> bool:
        me = self.plan.ranks[rank]
        return me.gen_tp_rank == 0 and me.gen_pp_rank == self.gen.pipeline_parallel - 1

    def __str__(self) -> str:
        return f"{self.gen} over {self.train}"
