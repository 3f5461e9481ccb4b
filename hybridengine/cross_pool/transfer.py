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

A mixture of experts' routed experts travel after the dense buckets as their
group's pieces (``reshard.expert_group``, moved by ``reshard.piece_mover``, the
colocated path's executor too): one message from each training rank to each
generation rank it serves. They come back as the generation stage's expert
tensors (``...local_experts.{k}.linear_fc1.weight`` [gate; up] and
``linear_fc2``), beside the flat buffer's dense views.

Every generation rank receives only its shard (the plan's bound), and the
training parameters are only read.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from hybridengine.cross_pool.plan import Bucket, CrossPoolPlan, Route, shard_buckets
from hybridengine.model.geometry import split_tp_shard
from hybridengine.model.spec import ModelSpec
from hybridengine.ops.copy_blocks import copy_blocks
from hybridengine.reshard.adapter_group import plan_adapters
from hybridengine.reshard.expert_group import ExpertPlan, plan_cross_pool_experts
from hybridengine.reshard.piece_mover import PieceMover
from hybridengine.reshard.pieces import PiecePlan

__all__ = ["CrossPoolTransfer", "GroupLink", "StandaloneLink", "message_bytes"]

def message_bytes(bucket_bytes: int) -> int:
    """The messages' bucket when a generation rank may hold ``bucket_bytes`` beyond its model during a streamed
    sync (``receive_buckets(keep=False)``): a bucket's messages and the area they are laid into, half each."""
    return max(bucket_bytes // 2, 1)


_PIECE_TAG = 1 << 24  # the piece groups' messages (experts, adapters), after every dense bucket's tags


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
                 link: GroupLink | StandaloneLink | None = None, bucket_bytes: int = 64 << 20,
                 lora: tuple[int, tuple[str, ...]] | None = None) -> None:
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
        # the groups that travel as pieces: a mixture of experts' routed experts, a LoRA actor's adapters
        # (``lora``: their rank and targets), whole on training rank 0 once gathered there
        self.pieces: dict[str, PiecePlan] = {}
        if spec.moe is not None:
            self.pieces["experts"] = plan_cross_pool_experts(spec, plan)
        if lora is not None:
            self.pieces["adapters"] = plan_adapters(spec, plan.train, *lora, receivers=plan.gen_world_size,
                                                    gathered=True)
        self.experts: ExpertPlan | None = self.pieces.get("experts")
        self._movers: dict[tuple[str, int | None, int | None], PieceMover] = {}

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
        if self.experts is not None:  # a bucket of layers at a time, one message to each generation rank it serves
            mover = self._mover("experts", train_rank, None)
            before = mover.bytes_sent
            for _ in mover.move_in_chunks(params, self.bucket_bytes):
                pass
            self.bytes_sent += mover.bytes_sent - before

    def _mover(self, kind: str, train_rank: int | None, gen_rank: int | None) -> PieceMover:
        """This rank's side of a group's piece plan (built once); each group's messages have a tag of their own,
        after every dense bucket's."""
        key = (kind, train_rank, gen_rank)
        if key not in self._movers:
            plan = self.pieces[kind]
            self._movers[key] = PieceMover(plan, self._exchange(_PIECE_TAG + list(self.pieces).index(kind)),
                                           train_rank, gen_rank, train_peer=self.train_ranks.__getitem__,
                                           receiver_peer=self.gen_ranks.__getitem__)
        return self._movers[key]

    def _exchange(self, tag: int):
        """Point to point over the link: every send and receive posted at once, then waited."""
        def exchange(sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> None:
            works = [self.link.isend(t.contiguous(), peer, tag) for peer, t in sorted(sends.items()) if t.numel()]
            works += [self.link.irecv(t, peer, tag) for peer, t in sorted(receives.items()) if t.numel()]
            for work in works:
                work.wait()
        return exchange

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
        views: dict[str, torch.Tensor] = {}
        for bucket in self.receive_buckets(gen_rank, dtype, device, keep=True):
            views.update(bucket)
        self.weights = views
        return views

    def receive_buckets(self, gen_rank: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                        keep: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """This generation rank's shard bucket by bucket, each as it lands (its parameters views of a buffer),
        then a mixture of experts' routed experts; collective like ``receive``: consume it to the end.

        ``keep``: the buckets land in one flat buffer of the whole shard (``buffer``), whose views stay valid;
        else in one buffer of the largest bucket, reused, so a bucket's views are valid until the next is
        asked for and the rank never holds more than a bucket of the shard."""
        coord = self.plan.gen_coordinate(gen_rank)
        element = torch.empty((), dtype=dtype).element_size()
        buckets = self.buckets(coord.tp_rank, coord.pp_rank, element)
        starts, total = [], 0
        for bucket in buckets:
            starts.append(total)
            total += sum(s.param.numel for s in bucket.sources)
        size = total if keep else max((sum(s.param.numel for s in b.sources) for b in buckets), default=0)
        if self.buffer is None or self.buffer.numel() != size or self.buffer.dtype != dtype:
            self.buffer = torch.empty(size, dtype=dtype, device=device)
        area = self.buffer
        if not keep:
            self.buffer = None  # not the shard: the area is this call's alone
        # Earlier chain positions first: a rank's position-p message depends only on position p-1 elsewhere.
        routes = sorted(self.plan.routes_into(gen_rank), key=lambda r: r.chain.index(gen_rank))
        # One inbox, reused by every bucket: its messages lie one after another in it, by segment.
        inbox = torch.empty(max((sum(b.sizes) for b in buckets), default=0), dtype=dtype, device=device)
        for b, bucket in enumerate(buckets):
            base = starts[b] if not keep else 0  # where the area starts in the shard's flat order
            parts: list[torch.Tensor | None] = [None] * len(bucket.sizes)
            posted, forwards = [], []
            for route in routes:  # every receive of the bucket posted at once, then waited in chain order
                at = route.chain.index(gen_rank)
                src = self.train_ranks[route.src] if at == 0 else self.gen_ranks[route.chain[at - 1]]
                first = sum(bucket.sizes[:route.position])
                part = inbox[first: first + bucket.sizes[route.position]]
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
            blocks = bucket.blocks if not base else [block._replace(dst_offset=block.dst_offset - base)
                                                      for block in bucket.blocks]
            copy_blocks(area, [p if p is not None else area.new_empty(0) for p in parts], list(blocks))
            for work, _ in forwards:
                work.wait()
            offset, views = starts[b] - base, {}
            for s in bucket.sources:
                views[s.param.name] = area[offset: offset + s.param.numel].view(s.param.shape)
                offset += s.param.numel
            yield views
        if self.experts is not None:  # a mixture of experts' routed experts, beside the dense buffer, by buckets
            mover = self._mover("experts", None, gen_rank)
            before = mover.bytes_received
            for chunk in mover.move_in_chunks({}, self.bucket_bytes, dtype, device):
                self.bytes_received += mover.bytes_received - before
                before = mover.bytes_received
                yield chunk

    # ------------------------------------------------------------ a LoRA actor's adapters
    def send_adapters(self, train_rank: int, adapters: dict) -> None:
        """Training rank 0 sends the adapters whole ((layer, linear, part) -> (A, B), gathered on it) to every
        generation rank, as their group's pieces; the other training ranks send nothing. Collective with the
        generation ranks' ``receive_adapters``."""
        mover = self._mover("adapters", train_rank, None)
        named = mover.group.named(adapters) if train_rank == 0 else {}
        before = mover.bytes_sent
        mover.move(named)
        self.bytes_sent += mover.bytes_sent - before

    def receive_adapters(self, gen_rank: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict:
        """The adapters whole, (layer, linear, part) -> (A, B), as training rank 0 ``send_adapters`` them."""
        mover = self._mover("adapters", None, gen_rank)
        before = mover.bytes_received
        whole = mover.group.whole(mover.move({}, dtype, device))
        self.bytes_received += mover.bytes_received - before
        return whole

    @classmethod
    def standalone(cls, spec: ModelSpec, plan: CrossPoolPlan, joint_rank: int, host: str, port: int,
                   timeout_s: float = 600.0, bucket_bytes: int = 64 << 20,
                   lora: tuple[int, tuple[str, ...]] | None = None) -> "CrossPoolTransfer":
        """A transfer over a process group of its own: ranks 0..T-1 the training pool, T.. the generation pool,
        meeting at the TCP store ``host:port``; collective over both pools."""
        from hybridengine.device import standalone_process_group

        t, g = plan.train.world_size, plan.gen_world_size
        group = standalone_process_group(host, port, joint_rank, t + g, timeout_s, "hybridflow-weights")
        return cls(spec, plan, range(t), range(t, t + g), StandaloneLink(group), bucket_bytes, lora)

    def release(self) -> None:
        """Drop the generation buffer (the generation engine keeps what it copied)."""
        self.buffer, self.weights = None, {}

    def close(self) -> None:
        """Drop the buffer and the link's process group, while its peers are still up."""
        self.release()
        self.link = None
