"""What a mixture of experts' routers did during a pass: expert load, dropped tokens, the router losses' values.

A forward hook on every router of the stage counts, per layer, the tokens
each expert received (the routing map after any capacity drop), the router's
softmax probabilities summed over tokens, and the squared log-sum-exp of its
logits. ``metrics()`` sums them over the pool (each rank routes its own
tokens: its data-parallel share, and under sequence parallelism its slice of
the sequence) and returns, named ``moe/...``:

- ``load_max_over_mean/layer_{i}``: the busiest expert's tokens over the mean
  (1.0 is perfect balance, ``num_experts / topk`` the worst), and
  ``load_max_over_mean`` the worst layer's;
- ``dropped_token_fraction``: routed slots dropped by the expert capacity
  (0 when dropless);
- ``aux_loss``: the Switch load-balancing loss of the whole pass,
  ``E / (k T^2) sum_e P_e c_e`` (P_e: expert e's summed probability, c_e: its
  tokens, T: tokens), averaged over layers, whatever its coefficient (0: off);
- ``z_loss``: the mean squared log-sum-exp of the router logits, averaged
  over layers.

Padding positions (megatron's ``padding_mask``, which the engine gives a
mixture of experts' forward) are left out, as the routers' own losses leave
them out. Ratios are
unaffected by activation recomputation, which runs a layer's forward twice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridengine.model.catalogue import layer_index
from hybridengine.model.spec import ModelSpec

__all__ = ["RoutingMonitor"]

class RoutingMonitor:
    def __init__(self, module: torch.nn.Module, spec: ModelSpec, groups: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.spec, self.pool_group = spec, groups.pool_group
        layers = spec.layers_of_stage(groups.pp_rank, groups.layout.pp)
        experts = spec.moe.num_experts
        # [layer, (counts | probability sums | tokens, z-loss sum)], where the stage's parameters are
        self.totals = torch.zeros(spec.num_layers, 2 * experts + 2, dtype=torch.float64,
                                  device=next(module.parameters()).device)
        self.handles = []
        for name, child in module.named_modules():
            if isinstance(child, TopKRouter):
                local = layer_index(name)
                self.handles.append(child.register_forward_hook(self._hook(layers[local])))

    def _hook(self, layer: int):
        experts = self.spec.moe.num_experts

        def record(router, args, output) -> None:
            with torch.no_grad():
                hidden = args[0].detach().reshape(-1, args[0].shape[-1])
                routing_map = output[1].detach().reshape(-1, experts)
                padding = args[1] if len(args) > 1 else None  # megatron's padding_mask, [S, B] (True: padding)
                if padding is not None:
                    real = ~padding.reshape(-1).to(hidden.device)
                    hidden, routing_map = hidden[real], routing_map[real]
                logits = F.linear(hidden, router.weight.detach()).double()
                row = self.totals[layer]
                row[:experts] += routing_map.sum(0).double()
                row[experts:2 * experts] += logits.softmax(-1).sum(0)
                row[-2] += routing_map.shape[0]
                row[-1] += logits.logsumexp(-1).square().sum()

        return record

    def reset(self) -> None:
        self.totals.zero_()

    def metrics(self) -> dict[str, float]:
        """The pass's routing figures over every rank of the pool (collective over it)."""
        totals = self.totals.clone()
        if dist.is_initialized() and dist.get_world_size(self.pool_group) > 1:
            dist.all_reduce(totals, group=self.pool_group)
        totals = totals.cpu()
        moe = self.spec.moe
        e, k = moe.num_experts, moe.topk
        counts, probs, tokens, z = totals[:, :e], totals[:, e:2 * e], totals[:, -2], totals[:, -1]
        seen = tokens > 0
        if not bool(seen.any()):
            return {}
        counts, probs, tokens, z = counts[seen], probs[seen], tokens[seen], z[seen]
        balance = counts.max(-1).values / counts.mean(-1).clamp(min=1e-12)
        out = {f"moe/load_max_over_mean/layer_{layer}": float(v)
               for layer, v in zip(seen.nonzero().flatten().tolist(), balance)}
        out["moe/load_max_over_mean"] = float(balance.max())
        out["moe/dropped_token_fraction"] = float(1 - counts.sum() / (tokens.sum() * k))
        out["moe/aux_loss"] = float((e / (k * tokens.square()) * (probs * counts).sum(-1)).mean())
        out["moe/z_loss"] = float((z / tokens).mean())
        return out
