"""The 3D-HybridEngine's executor: training shards -> this rank's generation shard, and back.

For a gather plan each rank all-gathers, within its micro-DP group, the
training shards that make up its generation shard into one flat generation
buffer, so each generation parameter is a view of the buffer. What moves in
which collective is a ``GatherSchedule``, computed once at construction:
row-joined parameters are gathered straight into their place in the buffer;
the rest arrive in a staging area and are laid out by one block copy per
unit. The collectives run two at a time: unit k+1's is in flight while unit
k is laid out. Temporary memory is two staging areas, at most one bucket.
For a slice plan nothing is sent: generation parameters are views (fc1: a
copy) of the rank's own shards.

Buckets are sized from a ``CollectiveProfile`` (the link's latency and
bandwidth, configured or measured): large enough that a collective's fixed
cost is small beside its bytes, and a parameter goes in place when the copy
it saves costs more than a collective of its own.

Training parameters are only read. Returning to training drops the buffer
(or moves it to host memory; on CPU it is then kept for the next step);
training continues exactly as before.

With ``release_training=True`` the rank's training shards give up their
memory while the generation weights exist, since every byte of them also
sits in the generation buffer (gather plans); returning to training copies
them back out of it. The generation buffer is then the only copy: no
redundant memory, as in HybridFlow section 5.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from hybridengine.device import CollectiveProfile, collective_profile
from hybridengine.model.geometry import split_tp_shard
from hybridengine.ops.copy_blocks import copy_blocks, whole_block
from hybridengine.reshard.schedule import GatherSchedule, GatherUnit
from hybridengine.reshard.transport import Transport
from hybridengine.reshard.weight_plan import WeightPlan, default_bucket_bytes, in_place_min_bytes

__all__ = ["Resharder"]


@dataclass(frozen=True)
class _UnitPlan:
    """A schedule unit bound to this rank: what it sends, where parts arrive, what it frees when done."""

    unit: GatherUnit
    own: tuple[torch.Tensor, ...]  # views of this rank's training shards, in send order
    table: torch.Tensor | None  # the staged unit's block table (int64 [n, 7])
    release: tuple[str, ...]  # own training parameters whose bytes are all in the buffer after this unit


class Resharder:
    """Builds and drops this rank's generation weights; the same object is reused every step."""

    def __init__(
        self,
        plan: WeightPlan,
        rank: int,
        training_params: dict[str, torch.Tensor],
        transport: Transport,
        bucket_bytes: int | None = None,
        profile: CollectiveProfile | None = None,
    ) -> None:
        """``plan``: the model's reshard plan (``weight_plan.plan_weights``); ``bucket_bytes``: the staging
        budget per step of the gather (two units in flight share it); ``None`` sizes it from ``profile``
        (default: ``hybridengine.device.collective_profile()``)."""
        self.weight_plan, self.plan, self.spec = plan, plan.layout, plan.spec
        self.rank, self.transport = rank, transport
        self.profile = profile or collective_profile()
        self.bucket_bytes = bucket_bytes or default_bucket_bytes(self.profile, self.plan.micro_dp_size)
        me = self.plan.ranks[rank]
        expected = {p.name: p.shape for p in plan.training_params(rank)}
        got = {name: tuple(t.shape) for name, t in training_params.items()}
        if got != expected:
            missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
            wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
            raise ValueError(f"training parameters do not match the model spec: missing {missing[:3]}, "
                             f"unexpected {extra[:3]}, wrong shapes {wrong[:3]}")
        self.params = training_params
        self.sources = plan.sources(rank)
        # Every rank of the world creates every micro-DP group, in the same order.
        self.group_keys = {group: transport.new_group(group) for group in self.plan.micro_dp_groups}
        self.my_group = me.micro_dp_group
        self.my_index = me.micro_dp_index
        self.buffer: torch.Tensor | None = None
        self._staging: list[torch.Tensor] = []
        self._keep_staging = False  # kept between transitions only while the buffer is kept
        self.weights: dict[str, torch.Tensor] = {}
        self.released: dict[int, int] = {}  # id(training parameter) -> its storage bytes, while released
        element = next(iter(training_params.values())).element_size()
        self.schedule: GatherSchedule | None = plan.schedule(rank, element, self.bucket_bytes,
                                                             in_place_min_bytes(self.profile))
        if self.schedule is not None:
            self.offsets = self.schedule.offsets
            self._units = self._bind(self.schedule)

    def _bind(self, schedule: GatherSchedule) -> list[_UnitPlan]:
        """The per-parameter work, done once: own send views, block tables, and when each own shard is free."""
        stage_of = [pp for _, pp in self.plan.ranks[self.rank].source_shards]
        mine = stage_of[self.my_index]
        last: dict[str, int] = {}  # own training parameter -> the last unit that lands any of its bytes
        for k, unit in enumerate(schedule.units):
            for m, pieces in enumerate(unit.sends):
                if stage_of[m] == mine:
                    for p in pieces:
                        last[p.name] = k
        # Replicated tensors every member holds: one local block copy from the own shards.
        self._local_sources = [self.params[p.name].view(-1) for p, _ in schedule.local]
        self._local_table = torch.tensor([tuple(whole_block(i, p.start, at, p.length))
                                          for i, (p, at) in enumerate(schedule.local)], dtype=torch.int64)
        plans = []
        for k, unit in enumerate(schedule.units):
            own = tuple(self.params[p.name].view(-1)[p.start: p.start + p.length] for p in unit.sends[self.my_index])
            table = None if unit.in_place else torch.tensor([tuple(b) for b in unit.blocks], dtype=torch.int64)
            plans.append(_UnitPlan(unit, own, table, tuple(n for n, j in last.items() if j == k)))
        # Two staging areas, used by staged units in turn: each fits the parts of its units.
        staged = [u for u in schedule.units if not u.in_place]
        self._area_numel = [max(u.numel for u in staged[i::2]) for i in range(min(len(staged), 2))]
        return plans

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
        first = next(iter(self.params.values()))
        schedule = self.schedule
        if (self.buffer is None or self.buffer.numel() != schedule.numel or self.buffer.device != first.device
                or self.buffer.dtype != first.dtype):
            # An offloaded buffer is not reused in place: its contents are rebuilt anyway.
            self.buffer = torch.empty(schedule.numel, dtype=first.dtype, device=first.device)
        if [a.numel() for a in self._staging] != self._area_numel or any(
                a.device != first.device or a.dtype != first.dtype for a in self._staging):
            self._staging = [torch.empty(n, dtype=first.dtype, device=first.device) for n in self._area_numel]
        self.weights = {s.param.name: self.buffer[self.offsets[s.param.name]: self.offsets[s.param.name]
                                                  + s.param.numel].view(s.param.shape) for s in self.sources}
        in_flight: deque = deque()
        n_staged = 0
        if self._local_sources:
            copy_blocks(self.buffer, self._local_sources, self._local_table)
            if release:
                self._release([p.name for p, _ in self.schedule.local])
        for plan in self._units:
            area = None
            if not plan.unit.in_place:
                area, n_staged = self._staging[n_staged % 2], n_staged + 1  # as _bind sized them
            in_flight.append(self._start(plan, area))
            if len(in_flight) == 2:  # unit k+1's collective is in flight while unit k is laid out
                self._finish(*in_flight.popleft(), release)
        while in_flight:
            self._finish(*in_flight.popleft(), release)
        if not self._keep_staging:
            self._staging = []
        return self.weights

    def _start(self, plan: _UnitPlan, area: torch.Tensor | None):
        """Post the unit's collective(s); returns what ``_finish`` needs."""
        unit, me, key = plan.unit, self.my_index, self.group_keys[self.my_group]
        sizes = unit.sizes
        if unit.in_place:
            parts = [None if t < 0 else self.buffer[t: t + n] for t, n in zip(unit.targets, sizes)]
        else:
            bounds = [0]
            for n in sizes:
                bounds.append(bounds[-1] + n)
            parts = [area[bounds[m]: bounds[m + 1]] for m in range(len(sizes))]
        if unit.collective == "all_gather":
            if unit.in_place:
                out, own = self.buffer[unit.targets[0]: unit.targets[0] + sum(sizes)], plan.own[0]
            else:  # the own part is laid into its place in the staging area and sent from there (in-place gather)
                out, own = area[: sum(sizes)], parts[me]
                if len(plan.own) == 1:
                    own.copy_(plan.own[0])
                else:
                    torch.cat(plan.own, out=own)
            return plan, parts, [self.transport.all_gather_into(out, own, key, async_op=True)]
        handles = []
        for m, (rank, part) in enumerate(zip(self.my_group, parts)):
            if not sizes[m]:
                continue
            if m == me:  # the sender's own part goes into place locally; it broadcasts from there
                if len(plan.own) == 1 and unit.in_place:
                    part.copy_(plan.own[0])
                else:
                    torch.cat(plan.own, out=part)
            handles.append(self.transport.broadcast(part, rank, key, async_op=True))
        return plan, parts, handles

    def _finish(self, plan: _UnitPlan, parts: list, handles: list, release: bool) -> None:
        for handle in handles:
            handle.wait()
        if plan.table is not None:
            empty = self.buffer.new_empty(0)
            copy_blocks(self.buffer, [p if p is not None else empty for p in parts], plan.table)
        if release:
            self._release(plan.release)

    def _own_pieces(self):
        """(training parameter, its copy inside the generation buffer) for every parameter this rank holds."""
        own_stage = self.plan.train.coordinate(self.rank).pp_rank
        for s in self.sources:
            if s.stage != own_stage:
                continue
            gen_tensor = self.weights[s.param.name]
            if s.param.geometry.replicated:  # the same on every TP rank, whichever member sent it
                yield self.params[s.train_names[0]], gen_tensor
            else:
                position = s.members.index(self.my_index)
                yield self.params[s.train_names[0]], split_tp_shard(s.param.geometry, gen_tensor, len(s.members), position)

    def _check_releasable(self) -> None:
        storages = {p.untyped_storage().data_ptr() for p in self.params.values()}
        if len(storages) != len(self.params):
            raise ValueError("training parameters share storage (a flat parameter buffer); they cannot be released one by one")
        if not all(p.untyped_storage().resizable() for p in self.params.values()):
            raise ValueError("training parameters live in memory that cannot be resized (e.g. memory-mapped); cannot release them")

    def _release(self, names: Sequence[str]) -> None:
        """Free the own training shards whose bytes are all in the buffer now.

        Every own shard has a copy in the buffer, except the last stage's copy
        of tied embeddings when the generation layout has one stage: that one stays.
        """
        for name in names:
            param = self.params[name]
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
            s.param.name: split_tp_shard(s.param.geometry, self.params[s.train_names[0]], me.slices, me.slice_index)
            for s in self.sources
        }

    # ------------------------------------------------------------------ to training
    def to_training(self, offload: bool = False) -> None:
        """Drop the generation weights (``offload``: keep the buffer in host memory for the next step)."""
        if self.released:
            self._restore_training_shards()
        self.weights = {}
        if offload and self.buffer is not None:
            device = self.buffer.device
            self.buffer = self.buffer.cpu()
            self._keep_staging = self.buffer.device == device  # on CPU the buffer stays where it is: keep all
        else:
            self.buffer, self._keep_staging = None, False
        if not self._keep_staging:
            self._staging = []
