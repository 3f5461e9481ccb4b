"""Mixtures of experts on megatron with expert parallelism against HF transformers in one process.

A tiny random Qwen3-MoE (8 experts, top-2, renormalized) at EP2 (DP4, the distributed optimizer), EP2 x TP2
(sequence-parallel; the actor through megatron's output layer), EP2 x PP2 and EP4; the same model replaying given
routes at TP2 x PP2 x EP2 (ETP1); and a Qwen2-MoE (shared expert behind a sigmoid gate, no renormalization) at
TP2 x EP2 with ETP1. Every case runs in one 4-process torchrun launch on CPU (gloo all-to-all), a pair of
worker groups per case (``moe_parity_program.py``). In fp32 the log-probs, entropies, the PPO loss, the
gradient norm and every weight after one Adam step agree with HF's model and a hand-written step to 1e-5, as
the dense parity test (``test_actor_parity``) demands; the planner's memory model equals every rank's state to
the byte; and the reference policy's export of the weights it loaded is the checkpoint, bit for bit. Four of
the cases reshard the actor for generation first (the 3D-HybridEngine over experts, at the bound).
"""

import json

import pytest
import torch

import test_actor_parity
from conftest import TESTS, run_torchrun
from state_checks import assert_state_predicted
from test_actor_parity import LR, hf_model, make_inputs, reference_step
from tiny_models import all_tensors, make_qwen2_moe, make_qwen3_moe

TEMPERATURE = 0.7
QWEN3_CASES = {  # name -> the case (moe_parity_program.py's keys)
    "EP2xDP4-distopt": dict(tp=1, pp=1, ep=2, dist_opt=True, reshard=[[2, 1, True], [1, 1, False]]),
    "EP2xTP2-logits": dict(tp=2, pp=1, ep=2, logits_output=True),
    "EP2xPP2": dict(tp=1, pp=2, ep=2),
    # Whole experts on two generation ranks from four EP ranks: the placement moves experts 4 and 5 to generation
    # rank 0 (and the routers' rows with them), where rank 2 holds them.
    "EP4xDP4": dict(tp=1, pp=1, ep=4, reshard=[[2, 1, True]]),
    "replay-TP2xPP2xEP2xETP1": dict(tp=2, pp=2, ep=2, etp=1, routes=True, export=True,
                                    reshard=[[2, 1, False], [1, 2, True]]),
}
QWEN2_CASES = {"TP2xEP2xETP1": dict(tp=2, pp=1, ep=2, etp=1, export=True, reshard=[[1, 1, False]])}


def launch(out, cases: dict) -> dict:
    """Every case of ``cases`` (name -> (model directory, case)) in one launch: name -> (model directory, case,
    result, batch, train, out, index)."""
    inputs = {}
    for i, (name, (model_dir, case)) in enumerate(cases.items()):
        batch, train = make_inputs(model_dir)
        if case.get("routes"):  # random experts for every token and layer (not the model's own choice); -1: padding
            g = torch.Generator().manual_seed(5)
            routes = torch.rand(*batch.batch["input_ids"].shape, 2, 8, generator=g).topk(2, -1).indices
            routes[~batch.batch["attention_mask"].bool()] = -1
            batch.batch["routed_experts"] = routes
        torch.save({"batch": batch, "train": train, "temperature": TEMPERATURE}, out / f"inputs_{i}.pt")
        inputs[name] = batch, train
    (out / "cases.json").write_text(json.dumps([{**case, "model": str(model_dir)} for model_dir, case in cases.values()]))
    proc = run_torchrun(TESTS / "megatron" / "moe_parity_program.py", [str(out)], 4, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return {name: (model_dir, case, torch.load(out / f"result_{i}.pt", weights_only=False), *inputs[name], out, i)
            for i, (name, (model_dir, case)) in enumerate(cases.items())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both models' cases, in one launch."""
    qwen3 = make_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"))
    qwen2 = make_qwen2_moe(tmp_path_factory.mktemp("tiny_qwen2_moe"))
    cases = {**{name: (qwen3, case) for name, case in QWEN3_CASES.items()},
             **{name: (qwen2, case) for name, case in QWEN2_CASES.items()}}
    return launch(tmp_path_factory.mktemp("moe_runs"), cases)


def assert_matches(run, ref):
    """The case's log-probs (actor and reference), entropies, loss, grad norm, weights after the step and state
    bytes equal the HF reference step's (1e-5) and the planner's (to the byte)."""
    model_dir, case, result, batch, _, out, i = run
    tp, pp, ep, etp = case["tp"], case["pp"], case["ep"], case.get("etp")
    assert_state_predicted(model_dir, result["state_bytes"], tp, pp, "fp32", True, case.get("dist_opt", False),
                           ep=ep, etp=etp)
    assert_state_predicted(model_dir, result["ref_state_bytes"], tp, pp, "fp32", False, ep=ep, etp=etp)
    mask = batch.batch["response_mask"].bool()
    got = result["log_probs"].batch
    torch.testing.assert_close(got["old_log_probs"][mask], ref["log_probs"][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(got["entropys"][mask], ref["entropy"][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(result["ref_log_probs"].batch["ref_log_prob"][mask], ref["log_probs"][mask],
                               atol=1e-5, rtol=0)
    for replica in result["metrics"]:
        assert replica["actor/pg_loss"][0] == pytest.approx(ref["pg_loss"], abs=1e-5)
        assert replica["actor/grad_norm"][0] == pytest.approx(ref["grad_norm"], abs=1e-5)
        assert replica["actor/lr"][0] == pytest.approx(LR)
    after = hf_model(out / f"after_step_{i}").state_dict()
    assert after.keys() == ref["state"].keys()
    for name, expected in ref["state"].items():
        torch.testing.assert_close(after[name], expected, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    if case.get("export"):  # import, then export with nothing trained: the checkpoint, expert by expert
        original, exported = all_tensors(model_dir), all_tensors(out / f"exported_{i}")
        assert exported.keys() == original.keys()
        for name, tensor in original.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
        files = set(json.loads((out / f"exported_{i}" / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert len(files) == pp * (1 + ep)  # dense tensors a file per stage, experts a file per stage and EP rank


@pytest.mark.parametrize("name", [n for n in QWEN3_CASES if not QWEN3_CASES[n].get("routes")])
def test_qwen3_moe_matches_hf(runs, name):
    run = runs[name]
    model_dir, case, result, batch, train, _, _ = run
    if result["activations"] is not None:  # PP 1: what autograd keeps, against the planner's MoE formula, which
        # assumes balanced routing (this random router is not: measured 0.84-1.13 of the prediction)
        from state_checks import assert_activations_predicted
        assert_activations_predicted(model_dir, result["activations"], case["tp"], "fp32", tolerance=0.2)
    assert result["layout"].startswith(f"TP{case['tp']}xPP{case['pp']}")
    assert_matches(run, reference_step(model_dir, batch, train, "token-mean"))
    for replica in result["metrics"]:  # dropless routing over a random router: every slot kept, imbalanced
        assert replica["actor/moe/dropped_token_fraction"][0] == pytest.approx(0.0, abs=1e-12)
        assert 1.0 < replica["actor/moe/load_max_over_mean"][0] <= 8 / 2
        assert replica["actor/moe/load_max_over_mean"][0] == max(
            replica[f"actor/moe/load_max_over_mean/layer_{i}"][0] for i in range(2))


def forced_routing(model, routes):
    """``model`` (an HF Qwen3-MoE) routing every token to ``routes`` [B, S, layers, k] instead of its own top-k;
    the gate weights are its softmax's, renormalized over the given experts as norm_topk_prob says."""
    import torch.nn.functional as F

    k = routes.shape[-1]
    routes = torch.where(routes < 0, torch.arange(k), routes)  # padding: experts 0..k-1, as megatron replays it
    for layer, block in enumerate(model.model.layers):
        gate = block.mlp.gate

        def forward(hidden, gate=gate, layer=layer):
            logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            chosen = routes[:, :, layer].reshape(-1, gate.top_k)
            top = probs.gather(1, chosen)
            if gate.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), chosen

        gate.forward = forward
    return model


def test_replayed_routes_are_what_every_pass_routes_by(runs, monkeypatch):
    """Routes given with the batch (random experts, not the model's choice) are replayed at TP2 x PP2 x EP2
    (sequence-parallel slices, each stage its own layers, experts across ranks): log-probs, the loss, the
    gradient norm and the weights after the step equal HF's model forced to the same routes, to 1e-5. The
    same case exports its reference policy's weights: the HF round trip at this layout."""
    run = runs["replay-TP2xPP2xEP2xETP1"]
    model_dir, _, _, batch, train, _, _ = run
    routes = batch.batch["routed_experts"]
    monkeypatch.setattr(test_actor_parity, "hf_model", lambda path: forced_routing(hf_model(path), routes))
    ref = reference_step(model_dir, batch, train, "token-mean")
    own = test_actor_parity.reference_log_probs(hf_model(model_dir), batch)[0]  # unforced
    mask = batch.batch["response_mask"].bool()
    assert (own - ref["log_probs"]).abs()[mask].max() > 0.05  # the routes are not the model's own choice
    assert_matches(run, ref)


def own_choice_agreement(model, batch, routes) -> torch.Tensor:
    """Per layer, the fraction of real tokens whose router's own top-k set (from its logits in this forward of
    ``model``) equals the set ``routes`` gives."""
    logits = []
    hooks = [block.mlp.gate.register_forward_hook(lambda mod, args, out: logits.append(out[0].detach()))
             for block in model.model.layers]
    b = batch.batch
    with torch.no_grad():
        model(b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
    for hook in hooks:
        hook.remove()
    real = b["attention_mask"].bool().flatten()
    out = []
    for layer, layer_logits in enumerate(logits):
        own = layer_logits.topk(routes.shape[-1], -1).indices.sort(-1).values
        given = routes[:, :, layer].reshape(-1, routes.shape[-1]).sort(-1).values
        out.append((own == given).all(-1)[real].float().mean())
    return torch.stack(out)


def test_routers_own_choice_is_counted_against_the_routes_replayed_or_not(runs):
    """router_replay/agreement: the fraction of (real token, layer) pairs whose router's own top-k equals the
    given routes, at TP2 x PP2 x EP2 (sequence-parallel slices, each stage its layers, padding left out),
    against HF's routers in the same forward: replaying (the routers' choice given the replayed layers below),
    and only compared (rollout_routed_experts: the model's own forward, whose log-probs are HF's unforced)."""
    model_dir, _, result, batch, _, _, _ = runs["replay-TP2xPP2xEP2xETP1"]
    routes = batch.batch["routed_experts"]
    real_tokens = int(batch.batch["attention_mask"].sum())
    replayed = own_choice_agreement(forced_routing(hf_model(model_dir), routes), batch, routes)
    unforced = own_choice_agreement(hf_model(model_dir), batch, routes)
    mask = batch.batch["response_mask"].bool()
    for got, want in ((result["log_probs"], replayed), (result["measured"], unforced)):
        metrics = got.meta_info["router_replay"]
        for layer in range(2):
            assert metrics[f"router_replay/agreement/layer_{layer}"] == pytest.approx(float(want[layer]), abs=0.5 / real_tokens)
        assert metrics["router_replay/agreement"] == pytest.approx(float(want.mean()), abs=0.5 / real_tokens)
    assert 0.0 < float(unforced.mean()) < 0.5  # random routes: the routers agree on few tokens
    own = test_actor_parity.reference_log_probs(hf_model(model_dir), batch)[0]
    torch.testing.assert_close(result["measured"].batch["old_log_probs"][mask], own[mask], atol=1e-5, rtol=0)
    assert result["metrics"][0]["actor/router_replay/agreement"][0] == pytest.approx(float(replayed.mean()),
                                                                                      abs=0.5 / real_tokens)


def test_qwen2_moe_shared_expert_with_expert_tp1_under_tp2(runs):
    run = runs["TP2xEP2xETP1"]
    model_dir, _, _, batch, train, _, _ = run
    assert_matches(run, reference_step(model_dir, batch, train, "token-mean"))


@pytest.mark.parametrize("name", [n for n, (_, c) in {**{k: (0, v) for k, v in QWEN3_CASES.items()},
                                                     **{k: (0, v) for k, v in QWEN2_CASES.items()}}.items() if c.get("reshard")])
def test_the_hybrid_engine_reshards_experts_exactly_at_the_bound(runs, name):
    """The actor's generation weights at each generation layout, on every rank: the dense part (the router, a
    shared expert, attention) equals the checkpoint cut at the generation TP x PP, the routed experts equal the
    checkpoint's under the plan's placement (whole, or cut across generation TP), the routers' rows follow the
    placement; each rank received the dense plan's bytes plus the experts' bound, nothing more. (The step
    after it, checked against HF above, shows training was left exactly as it was.)"""
    from hybridengine.model.catalogue import ExpertShard, stage_params
    from hybridengine.model.hf_mapping import cut_shard, hf_source
    from hybridengine.model.spec import ModelSpec
    from hybridengine.parallel.layout import ParallelLayout
    from hybridengine.reshard.plan import GenerationLayout
    from hybridengine.reshard.weight_plan import plan_weights
    from workers.megatron.hf_checkpoint import HFCheckpointReader

    model_dir, case, result, *_ = runs[name]
    reader, spec = HFCheckpointReader(model_dir), ModelSpec.from_pretrained(model_dir)
    train = ParallelLayout(case["tp"], case["pp"], 4 // (case["tp"] * case["pp"]), case["ep"], case.get("etp"))
    ffn = spec.moe.expert_ffn_hidden_size
    for (tg, pg, whole), reshard in zip(case["reshard"], result["reshards"]):
        gen = GenerationLayout(tg, pg, whole)
        plan = plan_weights(spec, train, gen)
        placement = torch.tensor(plan.experts.placement)
        if name == "EP4xDP4":
            assert plan.experts.placement == (0, 1, 4, 5, 2, 3, 6, 7)
        for rank, (stats, weights) in enumerate(zip(reshard["stats"], reshard["weights"])):
            me = plan.layout.ranks[rank]
            assert (stats["gen_tp_rank"], stats["gen_pp_rank"]) == (me.gen_tp_rank, me.gen_pp_rank)
            assert stats["reshard/bytes_received"] == plan.expected_bytes(rank, 4) + plan.experts.bound(rank, 4), (gen, rank)
            assert stats["reshard/expert_bytes_received"] == plan.experts.bound(rank, 4)
            shard = ExpertShard(tg, me.gen_tp_rank, 1) if whole else ExpertShard(1, 0, tg)
            params = stage_params(spec, tg, pg, me.gen_pp_rank, experts=shard)
            assert weights.keys() == {p.name for p in params}, (gen, rank)
            a, b = (0, ffn) if whole else (me.gen_tp_rank * ffn // tg, (me.gen_tp_rank + 1) * ffn // tg)
            for p in params:
                got = weights[p.name]
                if p.expert is None:
                    want = cut_shard(hf_source(p.name, spec, me.gen_pp_rank, pg), reader.read, spec, me.gen_tp_rank, tg)
                    if p.name.endswith("mlp.router.weight"):
                        want = want[placement]
                else:
                    hf = f"model.layers.{p.layer}.mlp.experts.{plan.experts.placement[p.expert]}"
                    want = (torch.cat([reader.read(f"{hf}.gate_proj.weight")[a:b], reader.read(f"{hf}.up_proj.weight")[a:b]])
                            if p.name.endswith("linear_fc1.weight") else reader.read(f"{hf}.down_proj.weight")[:, a:b])
                assert torch.equal(got, want), (gen, rank, p.name)
