"""The reshard plan of one model: for every rank, what its generation shard is made of, how it is gathered,
and how many bytes that moves.

``plan_weights(spec, train, gen)`` joins the layout plan (``reshard.plan``: which ranks form which groups)
with the model (``model.catalogue``: every parameter, its shard geometry and shape). Pure: no process group;
every rank computes the same plan and keeps its own part. The executors read it and only execute:

- the colocated ``Resharder`` (its sources, the gather schedule, the expected bytes);
- the baselines it is measured against (the sources they cut the generation shard by);
- the cross-pool transfer (the sources of each generation shard, in buckets);
- ``check_config``, which asks for the plan before any process starts, so a generation layout that the
  model's heads or the training layout cannot reach is refused there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

from hybridengine.device import CollectiveProfile
from hybridengine.model.catalogue import StageParam, stage_params
from hybridengine.model.geometry import Piece, join_blocks
from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.adapter_group import plan_adapters
from hybridengine.reshard.expert_group import ExpertPlan, check_expert_split, plan_experts
from hybridengine.reshard.pieces import PiecePlan
from hybridengine.reshard.plan import GenerationLayout, ReshardLayoutError, ReshardPlan, plan_reshard
from hybridengine.reshard.schedule import GatherSchedule, gather_schedule

__all__ = ["GenParamSource", "WeightPlan", "bucket_blocks", "bucket_sources", "cut_into_buckets", "default_bucket_bytes",
           "expected_bytes_received", "generation_sources", "in_place_min_bytes", "plan_weights", "refuse_routed_experts"]


@dataclass(frozen=True)
class GenParamSource:
    param: StageParam  # the generation parameter (name local to the generation stage)
    stage: int  # the training pipeline stage that holds its pieces
    members: tuple[int, ...]  # micro-DP positions that contribute a piece, in TP order
    train_names: tuple[str, ...]  # the piece's training parameter name on each of those members
    train_shapes: tuple[tuple[int, ...], ...]


def _training_stage_and_name(spec: ModelSpec, plan: ReshardPlan, gen_param: StageParam) -> tuple[int, str]:
    train = plan.train
    if gen_param.layer is not None:
        stage, local = spec.stage_of_layer(gen_param.layer, train.pp)
        suffix = gen_param.name.split(".", 3)[3]
        return stage, f"decoder.layers.{local}.{suffix}"
    if gen_param.name.startswith("embedding."):
        return 0, gen_param.name
    return train.pp - 1, gen_param.name


def generation_sources(spec: ModelSpec, plan: ReshardPlan, rank: int) -> list[GenParamSource]:
    """For each parameter of ``rank``'s generation shard, which micro-DP members hold its pieces."""
    me = plan.ranks[rank]
    gen = plan.gen
    train_shapes: dict[tuple[int, str], tuple[int, ...]] = {}
    for pp in range(plan.train.pp):
        for p in stage_params(spec, plan.train.tp, plan.train.pp, pp, routed=False):
            train_shapes[(pp, p.name)] = p.shape
    sources = []
    for param in stage_params(spec, gen.tensor_parallel, gen.pipeline_parallel, me.gen_pp_rank, routed=False):
        stage, train_name = _training_stage_and_name(spec, plan, param)
        members = tuple(sorted(
            (m for m, (tp, pp) in enumerate(me.source_shards) if pp == stage), key=lambda m: me.source_shards[m][0]
        ))
        if param.geometry.replicated:
            members = members[:1]  # identical on every TP rank: one copy is enough
        sources.append(GenParamSource(param, stage, members, (train_name,) * len(members),
                                      (train_shapes[(stage, train_name)],) * len(members)))
    return sources


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def expected_bytes_received(spec: ModelSpec, plan: ReshardPlan, rank: int, element_size: int,
                            sources: Sequence[GenParamSource] | None = None) -> int:
    """What a gather plan must move to ``rank``: every piece its micro-DP peers hold, once.

    A replicated tensor (a norm) is held whole by every member of its stage: where no stages merge, each
    member takes its own copy and nothing moves; across a merge its first holder sends it to the group.
    """
    if plan.kind == "slice":
        return 0
    me = plan.ranks[rank]
    one_stage = len({pp for _, pp in me.source_shards}) == 1
    return element_size * sum(
        _numel(shape) for s in (sources if sources is not None else generation_sources(spec, plan, rank))
        if not (one_stage and s.param.geometry.replicated)
        for m, shape in zip(s.members, s.train_shapes) if m != me.micro_dp_index
    )


def cut_into_buckets(items: Sequence, nbytes, owner, bucket_bytes: int) -> list[list]:
    """``items`` in order, cut into buckets of at most ``bucket_bytes`` (``nbytes(item)`` each); consecutive items
    of one ``owner(item)`` stay together, and what is larger than a bucket is alone in its own."""
    atoms: list[list] = []
    for item in items:
        if atoms and owner(item) == owner(atoms[-1][0]):
            atoms[-1].append(item)
        else:
            atoms.append([item])
    buckets, current, size = [], [], 0
    for atom in atoms:
        n = sum(nbytes(item) for item in atom)
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current += atom
        size += n
    return buckets + ([current] if current else [])


def bucket_sources(sources: Sequence[GenParamSource], element_size: int, bucket_bytes: int) -> list[list[GenParamSource]]:
    """``sources`` in order, cut into buckets of at most ``bucket_bytes`` of generation parameters (a larger
    parameter alone in its own); the parameters of one module (a linear's weight and bias) stay together, so an
    engine that loads a bucket at a time gets each of its layers whole."""
    return cut_into_buckets(sources, lambda s: s.param.numel * element_size,
                            lambda s: s.param.name.rpartition(".")[0], bucket_bytes)


def bucket_blocks(bucket: Sequence[GenParamSource], offsets: dict[str, int], members: int,
                  piece_shape=lambda source, i: source.train_shapes[i]) -> list:
    """The block copies that join a bucket's pieces into the flat generation buffer at ``offsets``.

    Member m's pieces lie one after another in its flat part, in the bucket's order; ``piece_shape(source,
    i)`` is the shape of ``source``'s i-th piece (its training shard by default).
    """
    cursor, blocks = [0] * members, []
    for s in bucket:
        pieces = []
        for i, m in enumerate(s.members):
            shape = tuple(piece_shape(s, i))
            pieces.append(Piece(m, cursor[m], shape))
            cursor[m] += _numel(shape)
        blocks += join_blocks(s.param.geometry, pieces, offsets[s.param.name], s.param.shape)
    return blocks


def default_bucket_bytes(profile: CollectiveProfile, group_size: int) -> int:
    """A bucket whose transfer takes about 16 collective latencies (the fixed cost is then ~6%), in whole MiB,
    between 4 and 64 MiB (the fixed bucket it replaces: peak memory stays where it was)."""
    if group_size < 2:
        return 4 << 20
    received_share = (group_size - 1) / group_size
    target = 16 * profile.latency_s * profile.link_bytes_per_s / received_share
    return int(min(max(target, 4 << 20), 64 << 20)) >> 20 << 20


def in_place_min_bytes(profile: CollectiveProfile) -> int:
    """Below this, a parameter's own collective costs more than the staging copy it would save."""
    return int(profile.latency_s * profile.copy_bytes_per_s)


@dataclass(frozen=True)
class WeightPlan:
    """``layout`` (the groups) for the model ``spec``: each rank's generation sources, gather schedule,
    buckets and expected bytes of the dense shard, computed on first use and kept. The parameter groups that
    travel as pieces (routed experts, adapters) are planned apart: ``piece_plans``."""

    spec: ModelSpec
    layout: ReshardPlan
    _sources: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _pieces: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def train(self) -> ParallelLayout:
        return self.layout.train

    @property
    def gen(self) -> GenerationLayout:
        return self.layout.gen

    def training_params(self, rank: int) -> list[StageParam]:
        """The parameters of ``rank``'s training shard that this plan moves (all but routed experts), in the
        catalogue's order."""
        return stage_params(self.spec, self.train.tp, self.train.pp, self.train.coordinate(rank).pp_rank, routed=False)

    @cached_property
    def experts(self) -> ExpertPlan | None:
        """A mixture of experts' routed experts: their group's piece plan (``reshard.expert_group``); None for a dense model."""
        return None if self.spec.moe is None else plan_experts(self.spec, self.train, self.gen)

    @cached_property
    def dense(self) -> PiecePlan:
        """The dense shard as a parameter group (``reshard.dense_group``): the one planner's view of what the
        micro-DP gather moves, for the one executor (``reshard_method: pieces``)."""
        from hybridengine.reshard.dense_group import plan_dense

        return plan_dense(self.spec, self.layout)

    def piece_plans(self, lora: tuple[int, tuple[str, ...]] | None = None) -> dict[str, PiecePlan]:
        """The groups that travel as pieces, by kind: a mixture of experts' routed experts, and (``lora``: the
        adapters' rank and targets) a LoRA actor's adapters, which every rank receives whole."""
        if lora not in self._pieces:  # planned once per LoRA setting, kept with the plan
            plans: dict[str, PiecePlan] = {}
            if self.experts is not None:
                plans["experts"] = self.experts
            if lora is not None:
                plans["adapters"] = plan_adapters(self.spec, self.train, *lora)
            self._pieces[lora] = plans
        return self._pieces[lora]

    def sources(self, rank: int) -> list[GenParamSource]:
        """For each parameter of ``rank``'s generation shard, which micro-DP members hold its pieces."""
        if rank not in self._sources:
            self._sources[rank] = generation_sources(self.spec, self.layout, rank)
        return self._sources[rank]

    def expected_bytes(self, rank: int, element_size: int) -> int:
        """What ``rank`` must receive: the lower bound (``expected_bytes_received``)."""
        return expected_bytes_received(self.spec, self.layout, rank, element_size, self.sources(rank))

    def schedule(self, rank: int, element_size: int, bucket_bytes: int, in_place_min: int) -> GatherSchedule | None:
        """The micro-DP gather of ``rank``'s group (None for a slice plan: nothing moves)."""
        if self.layout.kind != "gather":
            return None
        return gather_schedule(self.sources(rank), self.layout.ranks[rank].source_shards, element_size, bucket_bytes,
                               in_place_min)

    def buckets(self, rank: int, element_size: int, bucket_bytes: int) -> list[list[GenParamSource]]:
        """``rank``'s generation parameters in order, in buckets of at most ``bucket_bytes``."""
        return bucket_sources(self.sources(rank), element_size, bucket_bytes)


def plan_weights(spec: ModelSpec, train: ParallelLayout, gen: GenerationLayout) -> WeightPlan:
    """The plan of ``spec``'s weights from ``train`` to ``gen``; refuses a generation layout the model's heads
    (or experts) do not split into, or the training layout cannot reach (listing the legal ones)."""
    if spec.moe is not None:
        check_expert_split(spec, gen)
    spec.check_layout(gen.tensor_parallel, gen.pipeline_parallel,
                      *((gen.tensor_parallel, 1) if spec.moe is not None and gen.expert_parallel else ()))
    return WeightPlan(spec, plan_reshard(train, gen))


def refuse_routed_experts(spec: ModelSpec, engine: str, gen: GenerationLayout, experts_at_tensor_parallel: bool) -> None:
    """RL with a mixture of experts: every generation engine loads the resharded experts at generation TP1, and
    one that cuts them over TP (its traits' ``experts_at_tensor_parallel``: vLLM) at any TP, colocated with the
    actor or on a pool of their own. ``engine`` / ``gen``: the rollout's."""
    if spec.moe is None or experts_at_tensor_parallel or gen.tensor_parallel == 1:
        return
    raise ReshardLayoutError(
        f"{spec.architecture} is a mixture of experts ({spec.moe.num_experts} routed experts): its generation "
        f"engine must load the resharded experts, which rules out a {engine} rollout at {gen} (the megatron "
        f"rollout engine generates a mixture of experts at tensor_parallel 1 only; vLLM at any size)")
