"""The 3D-HybridEngine's executor across pools: training shards -> a generation pool's shards, bucket by bucket.

Each side of a ``CrossPoolPlan`` runs one ``CrossPoolTransfer``: a training
rank sends parts of its own training shard, a generation rank receives
exactly its generation shard into one flat buffer (each generation parameter
a view of it, in the generation stage's order, as ``Resharder`` lays it out)
and, under the broadcast method, forwards what it received to the next rank
of its replica chain. Buckets follow the generation shard's parameters; for
each bucket a segment travels as one message, so the temporary memory is one
bucket per route. Messages go point-to-point over a process group that spans
both pools (gloo on CPU, NCCL on GPU): a group of this world (torchrun, one
world for every pool) or a standalone group of its own (Ray, a world per pool).

A mixture of experts' routed experts travel after the dense buckets, one
message from each training rank to each generation rank it serves
(``cross_pool.experts``): a piece of units [a, b) as its gate rows, up rows and
down-projection columns. They come back as the generation stage's expert
tensors (``...local_experts.{k}.linear_fc1.weight`` [gate; up] and
``linear_fc2``), beside the flat buffer's dense views.

Every generation rank receives only its shard (the plan's bound), and the
training parameters are only read.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from hybridengine.cross_pool.experts import CrossPoolExperts, plan_cross_pool_experts
from hybridengine.cross_pool.plan import Bucket, CrossPoolPlan, Route, shard_buckets
from hybridengine.model.geometry import split_tp_shard
from hybridengine.model.spec import ModelSpec
from hybridengine.ops.copy_blocks import copy_blocks
from hybridengine.reshard.expert_pieces import assemble, cut_piece, pack, unpack

__all__ = ["CrossPoolTransfer", "GroupLink", "StandaloneLink"]

_FC1, _FC2 = "linear_fc1.weight", "linear_fc2.weight"
_EXPERT_TAG = 1 << 24  # the experts' messages, after every dense bucket's tags
_WHOLE_TAG = 1 << 25  # a tensor every generation rank receives whole (send_whole)


class GroupLink:
    """Point-to-point over a torch.distributed group of this world (None: the default group); peers are global ranks."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        return dist.isend(tensor, peer, group=self.group, tag=tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        return dist.irecv(tensor, peer, group=self.group, tag=tag)


class StandaloneLink:
    """Point-to-point over a process group outside the world (``hybridengine.device.standalone_process_group``);
    peers are that group's ranks."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        return self.group.send([tensor], peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        return self.group.recv([tensor], peer, tag)


class CrossPoolTransfer:
    """One rank's side of a cross-pool plan; build once, call ``send`` (training) or ``receive`` (generation) each step.

    ``train_ranks`` / ``gen_ranks``: the two pools' ranks on ``link``, in pool order; ``link``: the
    point-to-point path that spans both pools (default: the default group of this world).
    """

    def __init__(self, spec: ModelSpec, plan: CrossPoolPlan, train_ranks: Sequence[int], gen_ranks: Sequence[int],
                 link: GroupLink | StandaloneLink | None = None, bucket_bytes: int = 64 << 20) -> None:
        if len(train_ranks) != plan.train.world_size or len(gen_ranks) != plan.gen_world_size:
            raise ValueError(f"the plan needs {plan.train.world_size} training and {plan.gen_world_size} generation "
                             f"ranks; got {len(train_ranks)} and {len(gen_ranks)}")
        if set(train_ranks) & set(gen_ranks):
            raise ValueError(f"training ranks {list(train_ranks)} and generation ranks {list(gen_ranks)} overlap: "
                             f"a colocated rollout reshards in place (hybridengine.Resharder)")
        self.spec, self.plan, self.bucket_bytes = spec, plan, bucket_bytes
        self.link = link if link is not None else GroupLink()
        self.train_ranks, self.gen_ranks = list(train_ranks), list(gen_ranks)
        self.bytes_sent = self.bytes_received = 0
        self._buckets: dict[tuple[int, int], list[Bucket]] = {}
        self.buffer: torch.Tensor | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.experts: CrossPoolExperts | None = plan_cross_pool_experts(spec, plan) if spec.moe is not None else None

    # ----------------------------------------------------------- shared shape
    def buckets(self, gen_tp: int, gen_pp: int, element_size: int) -> list[Bucket]:
        """Generation shard (gen_tp, gen_pp)'s buckets (``cross_pool.plan.shard_buckets``); both sides agree."""
        key = (gen_tp, gen_pp)
        if key not in self._buckets:
            self._buckets[key] = shard_buckets(self.spec, self.plan, gen_tp, gen_pp, element_size, self.bucket_bytes)
        return self._buckets[key]

    def _tag(self, route: Route, bucket: int) -> int:
        return bucket * len(self.plan.shard_segments(route.gen_tp, route.gen_pp)) + route.position

    # ------------------------------------------------------------ training side
    def send(self, train_rank: int, params: dict[str, torch.Tensor]) -> None:
        """Send ``train_rank``'s parts to the generation pool (its training shard's parameters, names local to
        its stage); collective with the generation ranks' ``receive``."""
        routes = self.plan.routes_from(train_rank)
        element = next(iter(params.values())).element_size()
        depth = max((len(self.buckets(r.gen_tp, r.gen_pp, element)) for r in routes), default=0)
        for b in range(depth):
            pending = []
            for route in routes:
                buckets = self.buckets(route.gen_tp, route.gen_pp, element)
                if b >= len(buckets) or buckets[b].sizes[route.position] == 0:
                    continue
                message = self._segment_message(route, buckets[b], params)
                pending.append((self.link.isend(message, self.gen_ranks[route.chain[0]], self._tag(route, b)), message))
                self.bytes_sent += message.numel() * element
            for work, _ in pending:
                work.wait()
        if self.experts is not None:
            self._send_experts(train_rank, params)

    def _send_experts(self, train_rank: int, params: dict[str, torch.Tensor]) -> None:
        spec, train = self.spec, self.plan.train
        at = train.expert_coordinate(train_rank)
        per_rank = spec.moe.num_experts // train.ep
        first, offset = at.ep_rank * per_rank, at.etp_rank * (spec.moe.expert_ffn_hidden_size // train.etp)
        layers = spec.layers_of_stage(at.pp_rank, train.pp)
        pending = []
        for gen_rank, pieces in self.experts.sends(train_rank).items():
            blocks = []
            for _, piece in pieces:
                prefix = f"decoder.layers.{layers.index(piece.layer)}.mlp.experts.local_experts.{piece.expert - first}"
                blocks.append(cut_piece(params[f"{prefix}.{_FC1}"], params[f"{prefix}.{_FC2}"], piece, offset))
            message = pack(blocks)
            pending.append((self.link.isend(message, self.gen_ranks[gen_rank], _EXPERT_TAG), message))
            self.bytes_sent += message.numel() * message.element_size()
        for work, _ in pending:
            work.wait()

    def _receive_experts(self, gen_rank: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
        """This generation rank's experts by generation name, one message from each training rank serving it."""
        hidden = self.spec.hidden_size
        receives = self.experts.receives(gen_rank)
        posted = {}
        for train_rank, pieces in receives.items():
            flat = torch.empty(3 * hidden * sum(p.size for _, p in pieces), dtype=dtype, device=device)
            posted[train_rank] = (self.link.irecv(flat, self.train_ranks[train_rank], _EXPERT_TAG), flat)
        arrived = {}  # id(piece) -> (gate rows, up rows, down columns)
        for train_rank, (work, flat) in posted.items():
            work.wait()
            self.bytes_received += flat.numel() * flat.element_size()
            arrived.update(unpack(flat, [p for _, p in receives[train_rank]], hidden))
        weights = {}
        for need in self.experts.needs[gen_rank]:
            fc1, fc2 = assemble(need, lambda piece: arrived[id(piece)], hidden, dtype, device)
            weights[self.experts.generation_name(gen_rank, need, _FC1)] = fc1
            weights[self.experts.generation_name(gen_rank, need, _FC2)] = fc2
        return weights

    def _segment_message(self, route: Route, bucket: Bucket, params: dict[str, torch.Tensor]) -> torch.Tensor:
        seg = self.plan.shard_segments(route.gen_tp, route.gen_pp)[route.position]
        pieces = []
        for s in bucket.sources:
            for m, name in zip(s.members, s.train_names):
                if m == route.position:
                    pieces.append(split_tp_shard(s.param.geometry, params[name], seg.slices, seg.slice_index).reshape(-1))
        if not pieces:
            return next(iter(params.values())).new_empty(0)
        return torch.cat(pieces)

    # ---------------------------------------------------------- generation side
    def receive(self, gen_rank: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """This generation rank's shard (names local to its generation stage), each a view of one flat buffer;
        collective with the training ranks' ``send`` and, under broadcast, with the rest of the replica chain."""
        coord = self.plan.gen_coordinate(gen_rank)
        element = torch.empty((), dtype=dtype).element_size()
        buckets = self.buckets(coord.tp_rank, coord.pp_rank, element)
        sources = [s for bucket in buckets for s in bucket.sources]
        total = sum(s.param.numel for s in sources)
        if self.buffer is None or self.buffer.numel() != total or self.buffer.dtype != dtype:
            self.buffer = torch.empty(total, dtype=dtype, device=device)
        offset, views = 0, {}
        for s in sources:
            views[s.param.name] = self.buffer[offset: offset + s.param.numel].view(s.param.shape)
            offset += s.param.numel
        # Earlier chain positions first: a rank's position-p message depends only on position p-1 elsewhere.
        routes = sorted(self.plan.routes_into(gen_rank), key=lambda r: r.chain.index(gen_rank))
        forwards: list = []
        for b, bucket in enumerate(buckets):
            parts: list[torch.Tensor | None] = [None] * len(bucket.sizes)
            posted = []
            for route in routes:  # every receive of the bucket posted at once, then waited in chain order
                at = route.chain.index(gen_rank)
                src = self.train_ranks[route.src] if at == 0 else self.gen_ranks[route.chain[at - 1]]
                part = torch.empty(bucket.sizes[route.position], dtype=dtype, device=device)
                work = self.link.irecv(part, src, self._tag(route, b)) if part.numel() else None
                posted.append((route, at, part, work))
            for route, at, part, work in posted:
                if work is None:  # nothing of this segment in the bucket (a replicated tensor sent by another)
                    continue
                work.wait()
                self.bytes_received += part.numel() * element
                parts[route.position] = part
                if at + 1 < len(route.chain):
                    forwards.append((self.link.isend(part, self.gen_ranks[route.chain[at + 1]], self._tag(route, b)),
                                     part))
                    self.bytes_sent += part.numel() * element
            copy_blocks(self.buffer, [p if p is not None else self.buffer.new_empty(0) for p in parts],
                        list(bucket.blocks))
            for work, _ in forwards:
                work.wait()
            forwards = []
        if self.experts is not None:  # a mixture of experts' routed experts, beside the dense buffer
            views.update(self._receive_experts(gen_rank, dtype, device))
        self.weights = views
        return views

    # ------------------------------------------------ one tensor to every generation rank
    def send_whole(self, train_rank: int, tensor: torch.Tensor) -> None:
        """Training rank 0 sends ``tensor`` to every generation rank (e.g. a LoRA actor's adapters, whole); the
        other training ranks send nothing. Collective with the generation ranks' ``receive_whole``."""
        if train_rank != 0:
            return
        pending = [self.link.isend(tensor, peer, _WHOLE_TAG) for peer in self.gen_ranks]
        for work in pending:
            work.wait()
        self.bytes_sent += tensor.numel() * tensor.element_size() * len(self.gen_ranks)

    def receive_whole(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor training rank 0 ``send_whole``s, flat."""
        tensor = torch.empty(numel, dtype=dtype, device=device)
        self.link.irecv(tensor, self.train_ranks[0], _WHOLE_TAG).wait()
        self.bytes_received += tensor.numel() * tensor.element_size()
        return tensor

    @classmethod
    def standalone(cls, spec: ModelSpec, plan: CrossPoolPlan, joint_rank: int, host: str, port: int,
                   timeout_s: float = 600.0, bucket_bytes: int = 64 << 20) -> "CrossPoolTransfer":
        """A transfer over a process group of its own: ranks 0..T-1 the training pool, T.. the generation pool,
        meeting at the TCP store ``host:port``; collective over both pools."""
        from hybridengine.device import standalone_process_group

        t, g = plan.train.world_size, plan.gen_world_size
        group = standalone_process_group(host, port, joint_rank, t + g, timeout_s, "hybridflow-weights")
        return cls(spec, plan, range(t), range(t, t + g), StandaloneLink(group), bucket_bytes)

    def release(self) -> None:
        """Drop the generation buffer (the generation engine keeps what it copied)."""
        self.buffer, self.weights = None, {}

    def close(self) -> None:
        """Drop the buffer and the link's process group, while its peers are still up."""
        self.release()
        self.link = None
