"""The routing figures of a mixture of experts against megatron-core's own loss functions and counts by hand.

No process group: the monitor's hook is fed what a router returns for a few micro-batches, and its
figures are compared with megatron's ``switch_load_balancing_loss_func`` and ``z_loss_func`` over the
same tokens, and with expert loads counted directly from the routing maps.
"""

from types import SimpleNamespace

import pytest
import torch

from hybridengine.model.spec import ModelSpec, MoESpec
from hybridengine.parallel.layout import ParallelLayout
from workers.megatron.routing_monitor import RoutingMonitor

E, K, H = 6, 2, 8
SPEC = ModelSpec("Qwen3MoeForCausalLM", 32, H, 16, 2, 2, 1, 4, 1e-6, 1e4, 64, False, False,
                 moe=MoESpec(num_experts=E, topk=K, expert_ffn_hidden_size=4, norm_topk_prob=True))


def routed(router_weight, hidden, capacity=None):
    """What megatron's top-k router gives: (probs, routing map), slots over ``capacity`` per expert dropped."""
    logits = hidden @ router_weight.T
    top = logits.topk(K, -1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    if capacity is not None:
        keep = routing_map.long().cumsum(0) <= capacity
        routing_map &= keep
    probs = torch.zeros_like(logits).masked_scatter(routing_map, logits.softmax(-1)[routing_map])
    return probs, routing_map


@pytest.mark.parametrize("capacity", [None, 3])
def test_routing_figures_match_megatrons_losses(capacity):
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func

    groups = SimpleNamespace(pool_group=None, pp_rank=0, layout=ParallelLayout())
    monitor = RoutingMonitor(torch.nn.Linear(1, 1), SPEC, groups)  # no router in it: the hooks are fed by hand
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(E, H, generator=g) for _ in range(SPEC.num_layers)]
    hidden = {layer: [torch.randn(n, H, generator=g) for n in (5, 7)] for layer in range(SPEC.num_layers)}
    maps = {}
    for layer, weight in enumerate(weights):
        hook = monitor._hook(layer)
        for h in hidden[layer]:
            probs, routing_map = routed(weight, h, capacity)
            hook(SimpleNamespace(weight=weight), (h.unsqueeze(1),), (probs, routing_map))
            maps.setdefault(layer, []).append(routing_map)
    got = monitor.metrics()

    aux, z, balance = [], [], []
    for layer, weight in enumerate(weights):
        h = torch.cat(hidden[layer])
        logits = (h @ weight.T).double()
        counts = torch.cat(maps[layer]).sum(0).double()
        aux.append(switch_load_balancing_loss_func(logits.softmax(-1), counts, len(h), K, E, 1.0))
        z.append(z_loss_func(logits, 1.0))
        balance.append(counts.max() / counts.mean())
        assert got[f"moe/load_max_over_mean/layer_{layer}"] == pytest.approx(float(balance[-1]))
    assert got["moe/aux_loss"] == pytest.approx(float(sum(aux) / len(aux)))
    assert got["moe/z_loss"] == pytest.approx(float(sum(z) / len(z)))
    assert got["moe/load_max_over_mean"] == pytest.approx(float(max(balance)))
    slots = sum(float(torch.cat(maps[layer]).sum()) for layer in maps)
    assert got["moe/dropped_token_fraction"] == pytest.approx(1 - slots / (12 * K * SPEC.num_layers))
    assert (got["moe/dropped_token_fraction"] > 0) == (capacity is not None)

    monitor.reset()
    assert monitor.metrics() == {}  # nothing routed since
