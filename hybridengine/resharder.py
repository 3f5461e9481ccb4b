"""The 3D-HybridEngine's executor: training shards -> this rank's generation shard, and back.

For a gather plan each rank all-gathers, within its micro-DP group, the
training shards that make up its generation shard, bucket by bucket, and
joins them into one flat generation buffer laid out parameter by parameter
in the generation stage's order, so each generation parameter is a view of
the buffer. Temporary memory is one bucket. For a slice plan nothing is sent:
generation parameters are views (fc1: a copy) of the rank's own shards.

Training parameters are only read. Returning to training drops the buffer
(or moves it to host memory); training continues exactly as before.

With ``release_training=True`` the rank's training shards give up their
memory while the generation weights exist, since every byte of them also
sits in the generation buffer (gather plans); returning to training copies
them back out of it. The generation buffer is then the only copy: no
redundant memory, as in HybridFlow section 5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hybridengine.model_spec import ModelSpec
from hybridengine.param_catalogue import ShardKind
from hybridengine.reshard_plan import ReshardPlan
from hybridengine.stage_params import StageParam, stage_params
from hybridengine.ops.copy_blocks import copy_blocks
from hybridengine.tp_layout import Piece, join_blocks, split_tp_shard
from hybridengine.transport import Transport

__all__ = ["GenParamSource", "bucket_blocks", "bucket_sources", "generation_sources", "Resharder",
           "expected_bytes_received"]


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
        for p in stage_params(spec, plan.train.tp, plan.train.pp, pp):
            train_shapes[(pp, p.name)] = p.shape
    sources = []
    for param in stage_params(spec, gen.tensor_parallel, gen.pipeline_parallel, me.gen_pp_rank):
        stage, train_name = _training_stage_and_name(spec, plan, param)
        members = tuple(sorted(
            (m for m, (tp, pp) in enumerate(me.source_shards) if pp == stage), key=lambda m: me.source_shards[m][0]
        ))
        if param.kind == ShardKind.REPLICATED:
            members = members[:1]  # identical on every TP rank: one copy is enough
        sources.append(GenParamSource(param, stage, members, (train_name,) * len(members),
                                      (train_shapes[(stage, train_name)],) * len(members)))
    return sources


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def expected_bytes_received(spec: ModelSpec, plan: ReshardPlan, rank: int, element_size: int) -> int:
    """What a gather plan must move to ``rank``: every piece its micro-DP peers hold, once."""
    if plan.kind == "slice":
        return 0
    me = plan.ranks[rank].micro_dp_index
    return element_size * sum(
        _numel(shape) for s in generation_sources(spec, plan, rank) for m, shape in zip(s.members, s.train_shapes) if m != me
    )


def bucket_sources(sources: Sequence[GenParamSource], element_size: int, bucket_bytes: int) -> list[list[GenParamSource]]:
    """``sources`` in order, cut into buckets of at most ``bucket_bytes`` of generation parameters (a larger
    parameter alone in its own)."""
    buckets, current, size = [], [], 0
    for s in sources:
        nbytes = s.param.numel * element_size
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(s)
        size += nbytes
    return buckets + ([current] if current else [])


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
        blocks += join_blocks(s.param.kind, pieces, offsets[s.param.name], s.param.shape)
    return blocks


class Resharder:
    """Builds and drops this rank's generation weights; the same object is reused every step."""

    def __init__(
        self,
        spec: ModelSpec,
        plan: ReshardPlan,
        rank: int,
        training_params: dict[str, torch.Tensor],
        transport: Transport,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        self.spec, self.plan, self.rank, self.transport = spec, plan, rank, transport
        self.bucket_bytes = bucket_bytes
        me = plan.ranks[rank]
        own_stage = plan.train.coordinate(rank).pp_rank
        expected = {p.name: p.shape for p in stage_params(spec, plan.train.tp, plan.train.pp, own_stage)}
        got = {name: tuple(t.shape) for name, t in training_params.items()}
        if got != expected:
            missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
            wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
            raise ValueError(f"training parameters do not match the model spec: missing {missing[:3]}, "
                             f"unexpected {extra[:3]}, wrong shapes {wrong[:3]}")
        self.params = training_params
        self.sources = generation_sources(spec, plan, rank)
        # Where each generation parameter starts in the flat buffer (the order of self.sources).
        self.offsets, offset = {}, 0
        for s in self.sources:
            self.offsets[s.param.name] = offset
            offset += s.param.numel
        # Every rank of the world creates every micro-DP group, in the same order.
        self.group_keys = {group: transport.new_group(group) for group in plan.micro_dp_groups}
        self.my_group = me.micro_dp_group
        self.my_index = me.micro_dp_index
        self.buffer: torch.Tensor | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.released: dict[int, int] = {}  # id(training parameter) -> its storage bytes, while released

    # ---------------------------------------------------------------- to generation
    def to_generation(self, release_training: bool = False) -> dict[str, torch.Tensor]:
        """This rank's generation shard as megatron parameters (names local to its generation stage).

        ``release_training``: each training shard frees its memory as soon as
        its bucket is in the buffer, so the peak stays near one copy of the
        weights plus a bucket.
        """
        if self.plan.kind == "slice":
            self.weights = self._slice()
            return self.weights
        if release_training:
            self._check_releasable()
        return self._gather(release_training)

    def _gather(self, release: bool) -> dict[str, torch.Tensor]:
        dtype = next(iter(self.params.values())).dtype
        device = next(iter(self.params.values())).device
        total = sum(s.param.numel for s in self.sources)
        if self.buffer is None or self.buffer.numel() != total or self.buffer.device != device:
            # An offloaded buffer is not reused in place: its contents are rebuilt anyway.
            self.buffer = torch.empty(total, dtype=dtype, device=device)
        views = {}
        for s in self.sources:
            offset = self.offsets[s.param.name]
            views[s.param.name] = self.buffer[offset : offset + s.param.numel].view(s.param.shape)
        element = self.buffer.element_size()
        self.weights = views
        for bucket in self._buckets(element):
            self._gather_bucket(bucket, views)
            if release:
                self._release(bucket)
        return views

    def _buckets(self, element: int) -> list[list[GenParamSource]]:
        return bucket_sources(self.sources, element, self.bucket_bytes)

    def _gather_bucket(self, bucket: list[GenParamSource], views: dict[str, torch.Tensor]) -> None:
        d_g = len(self.my_group)
        sizes = [0] * d_g
        for s in bucket:
            for m, shape in zip(s.members, s.train_shapes):
                sizes[m] += _numel(shape)
        own_pieces = [self.params[name].reshape(-1) for s in bucket for m, name in zip(s.members, s.train_names) if m == self.my_index]
        own = torch.cat(own_pieces) if own_pieces else next(iter(self.params.values())).new_empty(0)
        parts = self.transport.gather_parts(self.group_keys[self.my_group], self.my_group, own, sizes)
        # Every parameter of the bucket joined into the buffer by one block copy.
        copy_blocks(self.buffer, [p.reshape(-1) for p in parts], bucket_blocks(bucket, self.offsets, d_g))

    def _own_pieces(self):
        """(training parameter, its copy inside the generation buffer) for every parameter this rank holds."""
        own_stage = self.plan.train.coordinate(self.rank).pp_rank
        for s in self.sources:
            if s.stage != own_stage:
                continue
            gen_tensor = self.weights[s.param.name]
            if s.param.kind == ShardKind.REPLICATED:  # the same on every TP rank, whichever member sent it
                yield self.params[s.train_names[0]], gen_tensor
            else:
                position = s.members.index(self.my_index)
                yield self.params[s.train_names[0]], split_tp_shard(s.param.kind, gen_tensor, len(s.members), position)

    def _check_releasable(self) -> None:
        storages = {p.untyped_storage().data_ptr() for p in self.params.values()}
        if len(storages) != len(self.params):
            raise ValueError("training parameters share storage (a flat parameter buffer); they cannot be released one by one")
        if not all(p.untyped_storage().resizable() for p in self.params.values()):
            raise ValueError("training parameters live in memory that cannot be resized (e.g. memory-mapped); cannot release them")

    def _release(self, bucket: list[GenParamSource]) -> None:
        """Free the own training shards whose bytes this bucket put into the buffer.

        Every own shard has a copy in the buffer, except the last stage's copy
        of tied embeddings when the generation layout has one stage: that one stays.
        """
        own_stage = self.plan.train.coordinate(self.rank).pp_rank
        for s in bucket:
            if s.stage != own_stage:
                continue
            param = self.params[s.train_names[0]]
            if id(param) not in self.released:
                self.released[id(param)] = param.untyped_storage().nbytes()
                param.untyped_storage().resize_(0)

    def _restore_training_shards(self) -> None:
        for param, piece in self._own_pieces():
            param.untyped_storage().resize_(self.released[id(param)])
            param.copy_(piece)
        self.released = {}

    def _slice(self) -> dict[str, torch.Tensor]:
        me = self.plan.ranks[self.rank]
        return {
            s.param.name: split_tp_shard(s.param.kind, self.params[s.train_names[0]], me.slices, me.slice_index)
            for s in self.sources
        }

    # ------------------------------------------------------------------ to training
    def to_training(self, offload: bool = False) -> None:
        """Drop the generation weights (``offload``: keep the buffer in host memory for the next step)."""
        if self.released:
            self._restore_training_shards()
        self.weights = {}
        if offload and self.buffer is not None:
            self.buffer = self.buffer.cpu()
        else:
            self.buffer = None
