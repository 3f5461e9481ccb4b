"""A mixture of experts' router losses leave padding out: megatron's load-balancing and z-losses, their gradients
and the ``moe/...`` figures equal those of the real tokens alone, whose formulas are computed here from HF
transformers' router logits of each row run on its own (the unpadded batch).

One launch of two gloo processes, two cases: TP2 (sequence-parallel: each rank routes half the sequence, and
the mask is split with it) and PP2 (the second stage's routers get the mask too). The batch has a short row
beside a long one in one micro-batch, so a third of its positions are padding, and replays the rollout's
routes (the model's own, -1 past each row's end: experts 0..k-1 when replayed), as ``algorithm.router_replay
rollout`` does. The only loss is the routers' (the step's loss is zero), so a router's gradient is the
gradient of ``aux_coeff * aux + z_coeff * z`` over its layer's real tokens. (On today's code, which gave the
routers no mask, every assertion on the gradients and figures fails: a third of the tokens are padding.)
"""

import pytest
import torch

from dist_utils import run_cases_in_processes
from tiny_models import make_qwen3_moe

AUX = 0.1
LENGTHS = (9, 5)  # real tokens of the two rows; the short one is left-padded in the batch, as a prompt is


def _batch():
    g = torch.Generator().manual_seed(3)
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        ids[row, width - n:] = torch.randint(3, 256, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def _reference(model_dir, path):
    """Per layer, the router's own top-k of every real token, and the gradients of its losses over them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = model.config
    E, k = config.num_experts, config.num_experts_per_tok
    ids, mask = _batch()
    per_row = [model(ids[row][mask[row].bool()].unsqueeze(0), output_router_logits=True).router_logits
               for row in range(len(ids))]
    routes = torch.full((*ids.shape, config.num_hidden_layers, k), -1, dtype=torch.long)
    aux, z = [], []
    for layer in range(config.num_hidden_layers):
        logits = torch.cat([row_logits[layer].reshape(-1, E) for row_logits in per_row])  # [real tokens, E]
        top = logits.topk(k, -1).indices
        start = 0
        for row, n in enumerate(LENGTHS):
            routes[row, mask[row].bool(), layer] = top[start:start + n]
            start += n
        T = len(logits)
        counts = torch.zeros(E).index_add_(0, top.flatten(), torch.ones(top.numel()))
        aux.append(E / (k * T * T) * (logits.softmax(-1).sum(0) * counts).sum())
        z.append(logits.logsumexp(-1).square().mean())
    gates = [model.model.layers[layer].mlp.gate.weight for layer in range(config.num_hidden_layers)]
    grads = {name: torch.autograd.grad(sum(losses), gates, retain_graph=True)
             for name, losses in (("aux", aux), ("z", z))}
    torch.save({"routes": routes, "grads": grads, "aux": float(torch.stack(aux).mean()),
                "z": float(torch.stack(z).mean())}, path)


def _case(rank, world_size, model_dir, reference, tp, pp, z_coeff):
    from hybridengine.model.catalogue import layer_index
    from workers.data_proto import DataProto
    from workers.megatron.config import EngineConfig, OptimConfig
    from workers.megatron.engine import MegatronEngine

    ref = torch.load(reference, weights_only=False)
    engine = MegatronEngine(model_dir, EngineConfig(tensor_parallel=tp, pipeline_parallel=pp, precision="fp32",
                                                    micro_batch_size=len(LENGTHS), moe_aux_loss_coeff=AUX,
                                                    moe_z_loss_coeff=z_coeff), world_size, OptimConfig())
    ids, mask = _batch()
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, -3:],
                                 "routed_experts": ref["routes"]})
    engine.zero_grad()
    outputs = engine.run(batch, lambda mb, output: (output.float().sum() * 0, {}), forward_only=False)
    assert outputs.padding.after > outputs.padding.real  # the micro-batch holds padding
    layers = engine.spec.layers_of_stage(engine.groups.pp_rank, pp)
    routers = {layers[layer_index(name)]: p for name, p in engine.module().named_parameters()
               if name.endswith("mlp.router.weight")}
    assert routers
    for layer, weight in routers.items():
        want = AUX * ref["grads"]["aux"][layer] + z_coeff * ref["grads"]["z"][layer]
        torch.testing.assert_close(weight.main_grad, want, atol=1e-6, rtol=1e-4,
                                   msg=lambda m, layer=layer: f"layer {layer}'s router gradient: {m}")
    metrics = engine.routing_metrics()
    assert metrics["moe/aux_loss"] == pytest.approx(ref["aux"], rel=1e-5)
    assert metrics["moe/z_loss"] == pytest.approx(ref["z"], rel=1e-5)


def test_router_losses_and_their_gradients_leave_padding_out(tmp_path):
    model_dir = make_qwen3_moe(tmp_path / "model")
    _reference(model_dir, tmp_path / "reference.pt")
    # megatron's z-loss under sequence parallelism is the mean of each TP rank's mean (moe_padding): TP2's case
    # holds the load-balancing loss alone.
    cases = {f"TP{tp}xPP{pp}": (model_dir, tmp_path / "reference.pt", tp, pp, z) for tp, pp, z in ((2, 1, 0.0),
                                                                                                (1, 2, 0.01))}
    outcome = run_cases_in_processes(_case, 2, cases)
    assert outcome == {name: None for name in cases}, "\n".join(f"{n}: {w}" for n, w in outcome.items() if w)


def test_replay_with_an_expert_capacity_is_refused(tmp_path):
    """A capacity would drop replayed tokens that the rollout's experts computed: refused by the engine's check
    (and before launch, ``test_config``)."""
    from hybridengine.model.spec import ModelSpec
    from workers.megatron.routing_replay import check_replay

    spec = ModelSpec.from_pretrained(make_qwen3_moe(tmp_path))
    with pytest.raises(ValueError, match="moe_capacity_factor 1.25"):
        check_replay(spec, None, 1.25)
    check_replay(spec, None, None)
