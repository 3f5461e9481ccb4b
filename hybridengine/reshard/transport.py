"""Transports: how resharding moves bytes between ranks.

A transport offers collectives over groups it created: all-gather of equal
parts (into a list, or into one flat output, which may be a slice of the
generation buffer) and broadcast, each optionally asynchronous, and counts
the bytes this rank receives, so the lower bound can be checked rather than
claimed. ``gather_parts`` (every member's flat part, sizes possibly
different or zero, to every member) is built on them; ``exchange`` sends and
receives point to point (a parameter group's pieces, ``reshard.piece_mover``). ``TorchTransport``
uses torch.distributed (gloo on CPU, NCCL on GPU); a point-to-point or RDMA
transport implements the same methods.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hybridengine.device.torch_compat import all_gather_single

__all__ = ["Transport", "TorchTransport"]


class Transport(abc.ABC):
    def __init__(self) -> None:
        self.bytes_received = 0

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Any:
        """Called by every rank of the world for every group, in the same order; returns a key."""

    @abc.abstractmethod
    def all_gather(self, own: torch.Tensor, group_key: Any) -> list[torch.Tensor]:
        """Equal-sized parts of every member, in group order."""

    @abc.abstractmethod
    def all_gather_into(self, out: torch.Tensor, own: torch.Tensor, group_key: Any, async_op: bool = False):
        """Every member's equal part into the flat ``out``, member after member in group order.

        ``own`` may be this member's own slice of ``out`` (an in-place gather). Returns a handle with
        ``wait()`` when ``async_op``; ``out`` is ready after it.
        """

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int, group_key: Any, async_op: bool = False):
        """``src``'s tensor into ``tensor`` on every member (a handle with ``wait()`` when ``async_op``)."""

    @abc.abstractmethod
    def exchange(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> None:
        """Point to point over the world: each of ``sends`` to its peer (a global rank), each of ``receives``
        filled from its peer; returns when every one is done. Every pair's sizes are known to both sides."""

    def gather_parts(self, group_key: Any, ranks: Sequence[int], own: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Every member's flat part, in ``ranks`` order; ``sizes`` (element counts) are known to all."""
        if len(ranks) == 1:
            return [own]
        if len(set(sizes)) == 1:
            return self.all_gather(own, group_key)
        me = dist.get_rank()
        parts = []
        for rank, size in zip(ranks, sizes):  # every member joins every broadcast, in order
            buffer = own if rank == me else torch.empty(size, dtype=own.dtype, device=own.device)
            if size:
                self.broadcast(buffer, rank, group_key)
            parts.append(buffer)
        return parts


class _Done:
    """The handle of a collective that had nothing to wait for."""

    def wait(self) -> bool:
        return True


class TorchTransport(Transport):
    def __init__(self) -> None:
        super().__init__()
        self._groups: dict[tuple[int, ...], Any] = {}

    def new_group(self, ranks: Sequence[int]) -> Any:
        key = tuple(ranks)
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        return key

    def all_gather(self, own: torch.Tensor, group_key: Any) -> list[torch.Tensor]:
        parts = [torch.empty_like(own) for _ in group_key]
        dist.all_gather(parts, own.contiguous(), group=self._groups[group_key])
        self.bytes_received += own.numel() * own.element_size() * (len(group_key) - 1)
        # torch orders a group's members by global rank; hand parts back in the key's order.
        by_rank = dict(zip(sorted(group_key), parts))
        return [by_rank[r] for r in group_key]

    def all_gather_into(self, out: torch.Tensor, own: torch.Tensor, group_key: Any, async_op: bool = False):
        if len(group_key) == 1:  # a group of one (TP -> the same TP): the own part is the whole
            out.copy_(own)
            return _Done() if async_op else None
        if list(group_key) != sorted(group_key):
            # torch orders a group's members by global rank: the flat output follows that order.
            raise ValueError(f"all_gather_into needs a group in rank order, got {group_key}")
        if out.numel() != own.numel() * len(group_key):
            raise ValueError(f"all_gather_into: out has {out.numel()} elements, expected {len(group_key)} x {own.numel()}")
        self.bytes_received += own.numel() * own.element_size() * (len(group_key) - 1)
        return all_gather_single(out, own, group=self._groups[group_key], async_op=async_op)

    def exchange(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> None:
        works = [dist.isend(t.contiguous(), peer) for peer, t in sorted(sends.items()) if t.numel()]
        works += [dist.irecv(t, peer) for peer, t in sorted(receives.items()) if t.numel()]
        for work in works:
            work.wait()
        self.bytes_received += sum(t.numel() * t.element_size() for t in receives.values())

    def broadcast(self, tensor: torch.Tensor, src: int, group_key: Any, async_op: bool = False):
        if len(group_key) == 1:
            return _Done() if async_op else None
        if dist.get_rank() != src:
            self.bytes_received += tensor.numel() * tensor.element_size()
        return dist.broadcast(tensor, src=src, group=self._groups[group_key], async_op=async_op)
