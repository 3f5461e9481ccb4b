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
layers.

Replay covers the forward passes; megatron's full activation recomputation
replays again in the backward pass, which the engine does not drive, so the
two are refused together (``check_replay``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["ROUTED_EXPERTS", "RoutingReplay", "check_replay"]

ROUTED_EXPERTS = "routed_experts"


def check_replay(spec, recompute_granularity: str | None) -> None:
    """Raise unless routes can be replayed on ``spec`` with this recomputation."""
    if spec.moe is None:
        raise ValueError(f"routed experts to replay were given for {spec.architecture}, which has no router "
                         f"(routing replay is for mixtures of experts)")
    if recompute_granularity == "full":
        raise ValueError("routing replay with recompute_granularity 'full' is not supported: the recomputed "
                         "forward would route afresh; use 'selective' or none")


class RoutingReplay:
    """This stage's routers, in layer order, and the replay of a micro-batch's routes through them."""

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
                found[int(name.split("decoder.layers.", 1)[1].split(".", 1)[0])] = child.router_replay
        self.replays = [found[i] for i in sorted(found)]

    @contextmanager
    def replaying(self, routes: torch.Tensor) -> Iterator[None]:
        """Within: the forward of a micro-batch whose routes are ``routes`` [B, W, layers, k] (global layers)."""
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
        for local, replay in enumerate(self.replays):
            layer_routes = routes[:, tokens, self.layers[local]]  # [B, S', k]
            replay.set_target_indices(layer_routes.transpose(0, 1).reshape(-1, k).long())
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for replay in self.replays:
                replay.clear_router_replay_action()
                replay.clear_indices()
