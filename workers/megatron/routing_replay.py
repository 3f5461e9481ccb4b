"""Routing replay: a mixture of experts' routers choose the experts a batch says, not their own top-k.

A batch may carry ``routed_experts`` [B, S, layers, k] (integer expert ids):
for every token position and MoE layer, the k experts chosen when the
sequence was generated (rollout routing replay, R3). The engine's passes then
route every token to those experts: megatron's ``RouterReplay`` (one per
router, built with ``moe_enable_routing_replay``) takes each micro-batch's
indices before its forward and computes the gate probabilities of the given
experts from the router's own scores, so the router still learns. The token
order is megatron's: sequence-major ([S, B] flattened), and under sequence
parallelism each TP rank's slice of the sequence. Each stage replays its own
layers. A position whose route is unknown (-1: padding, a response's last
token) is routed to experts 0..k-1, which no loss reads. Padding is also
masked out of the routers' own losses and counts (``moe_padding``), so the
load-balancing and z-losses, and their gradients, are those of the real
tokens alone.

A batch may instead carry the rollout's routes as ``rollout_routed_experts``:
the routers then choose as usual, and only how often they agree with the
rollout is counted (``algorithm.router_replay: measure``). Replayed or not,
``RoutingReplay.metrics`` gives the fraction of (token, layer) pairs whose own
top-k set equals the given one.

Replay covers the forward passes; megatron's full activation recomputation
replays again in the backward pass, which the engine does not drive, so the
two are refused together (``check_replay``), as is an expert capacity, which
would drop replayed tokens that the rollout's experts computed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from hybridengine.model.catalogue import layer_index

__all__ = ["ROLLOUT_ROUTES", "ROUTED_EXPERTS", "RoutingReplay", "check_replay"]

ROUTED_EXPERTS = "routed_experts"  # routes to replay
ROLLOUT_ROUTES = "rollout_routed_experts"  # the rollout's routes, only compared with the routers' own choice


def check_replay(spec, recompute_granularity: str | None, capacity_factor: float | None = None) -> None:
    """Raise unless routes can be replayed on ``spec`` with this recomputation and expert capacity."""
    if spec.moe is None:
        raise ValueError(f"routed experts to replay were given for {spec.architecture}, which has no router "
                         f"(routing replay is for mixtures of experts)")
    if recompute_granularity == "full":
        raise ValueError("routing replay with recompute_granularity 'full' is not supported: the recomputed "
                         "forward would route afresh; use 'selective' or none")
    if capacity_factor is not None:
        raise ValueError(f"routing replay with moe_capacity_factor {capacity_factor} is not supported: the "
                         f"capacity would drop replayed tokens that the rollout's experts computed; use null "
                         f"(dropless)")


class RoutingReplay:
    """This stage's routers, in layer order; the replay of a micro-batch's routes through them, and how often
    the routers' own top-k agrees with those routes.

    ``replaying(routes, replay=True)`` routes the forward's tokens as ``routes`` say; with ``replay=False``
    the routers choose as usual and their choice is only compared. Either way, every (token, layer) whose
    route is known (not -1) counts towards ``metrics()``: the fraction whose own top-k set (what the router
    would choose, given this forward's hidden states) equals the given one.
    """

    def __init__(self, module: torch.nn.Module, spec, layers: range, tp_rank: int, tp: int,
                 sequence_parallel: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.spec, self.layers = spec, layers
        self.tp_rank, self.tp, self.sequence_parallel = tp_rank, tp, sequence_parallel
        found = {}
        for name, child in module.named_modules():
            if isinstance(child, TopKRouter):
                if child.router_replay is None:
                    raise ValueError("the model's routers were built without megatron's routing replay "
                                     "(moe_enable_routing_replay)")
                found[layer_index(name)] = child.router_replay
        self.replays = [found[i] for i in sorted(found)]
        # Every TP rank routes the same tokens unless the sequence is split over them: count them once.
        self.counts_here = sequence_parallel or tp_rank == 0
        self.device = next(module.parameters()).device
        self.counts: torch.Tensor | None = None  # [layers, (agreeing, compared)], on the routers' device
        self._given: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # local layer -> (routes, known)
        for local, replay in enumerate(self.replays):
            replay.get_replay_topk = self._comparing(replay, local)

    def _comparing(self, replay, local: int):
        """``replay.get_replay_topk`` that also counts the router's own top-k against the given routes."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        original = replay.get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            result = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if local in self._given:
                own = result[1]
                if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                    with torch.no_grad():
                        own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)[1]
                self._count(self.layers[local], own, *self._given[local])
            return result

        return get_replay_topk

    def _count(self, layer: int, own: torch.Tensor, given: torch.Tensor, known: torch.Tensor) -> None:
        if not self.counts_here:
            return
        if self.counts is None:
            self.counts = torch.zeros(self.spec.num_layers, 2, dtype=torch.float64, device=self.device)
        known = known.to(own.device)
        same = (own.sort(-1).values == given.to(own.device).sort(-1).values).all(-1) & known
        self.counts[layer, 0] += same.sum().to(self.device)
        self.counts[layer, 1] += known.sum().to(self.device)

    @contextmanager
    def replaying(self, routes: torch.Tensor, replay: bool = True) -> Iterator[None]:
        """Within: the forward of a micro-batch whose routes are ``routes`` [B, W, layers, k] (global layers;
        -1: unknown, routed to experts 0..k-1 when replayed); ``replay`` False: only compared."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        k = self.spec.moe.topk
        if routes.dim() != 4 or routes.shape[2] != self.spec.num_layers or routes.shape[3] != k:
            raise ValueError(f"routed_experts must be [batch, tokens, {self.spec.num_layers} layers, {k}], "
                             f"got {tuple(routes.shape)}")
        width = routes.shape[1]
        tokens = slice(None)
        if self.sequence_parallel:
            part = width // self.tp
            tokens = slice(self.tp_rank * part, (self.tp_rank + 1) * part)
        for local, router_replay in enumerate(self.replays):
            layer_routes = routes[:, tokens, self.layers[local]].transpose(0, 1).reshape(-1, k).long()  # [S' x B, k]
            known = layer_routes[:, 0] >= 0
            layer_routes = torch.where(known.unsqueeze(-1), layer_routes,
                                       torch.arange(k, device=layer_routes.device).expand_as(layer_routes))
            self._given[local] = (layer_routes, known)
            if replay:
                router_replay.set_target_indices(layer_routes)
                router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            self._given = {}
            for router_replay in self.replays:
                router_replay.clear_router_replay_action()
                router_replay.clear_indices()

    def metrics(self, group) -> dict[str, float]:
        """The agreement counted since the last call, over every rank of ``group`` (collective), then
        forgotten: ``router_replay/agreement`` over all (token, layer) pairs and per layer."""
        counts = self.counts if self.counts is not None else torch.zeros(
            self.spec.num_layers, 2, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        self.counts = None
        counts = counts.cpu()
        if counts[:, 1].sum() == 0:
            return {}
        out = {f"router_replay/agreement/layer_{layer}": float(a / n)
               for layer, (a, n) in enumerate(counts.tolist()) if n > 0}
        out["router_replay/agreement"] = float(counts[:, 0].sum() / counts[:, 1].sum())
        return out
