"""Mixtures of experts on megatron with expert parallelism against HF transformers in one process.

A tiny random Qwen3-MoE (8 experts, top-2, renormalized) at EP2 (DP4), EP2 x TP2 and EP2 x PP2, and a
Qwen2-MoE (shared expert behind a sigmoid gate, no renormalization) at TP2 x EP2 with ETP1, each a real
4-process torchrun job on CPU (gloo all-to-all). In fp32 the log-probs, entropies, the PPO loss, the
gradient norm and every weight after one Adam step agree with HF's model and a hand-written step to 1e-5,
as the dense parity test (``test_actor_parity``) demands; the export after the step is HF's layout.
"""

import pytest
import torch

from test_actor_parity import LR, hf_model, make_inputs, reference_step
from conftest import TESTS, run_torchrun
from state_checks import assert_state_predicted
from tiny_models import make_qwen2_moe, make_qwen3_moe

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"))


def run_moe_parity(model_dir, tmp_path, tp, pp, ep, etp, nproc, extra=()):
    batch, train = make_inputs(model_dir)
    torch.save({"batch": batch, "train": train}, tmp_path / "inputs.pt")
    args = [str(model_dir), str(tmp_path), "--tp", str(tp), "--pp", str(pp), "--ep", str(ep),
            "--temperature", str(TEMPERATURE), *extra] + (["--etp", str(etp)] if etp else [])
    proc = run_torchrun(TESTS / "megatron" / "parity_program.py", args, nproc, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    ref = reference_step(model_dir, batch, train, "token-mean")
    # The planner's memory model, to the byte, with each rank's experts (and their own DDP buffer).
    dist_opt = "--dist-opt" in extra
    assert_state_predicted(model_dir, result["state_bytes"], tp, pp, "fp32", True, dist_opt, ep=ep, etp=etp)
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
    after = hf_model(tmp_path / "after_step").state_dict()
    assert after.keys() == ref["state"].keys()
    for name, expected in ref["state"].items():
        torch.testing.assert_close(after[name], expected, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    return result


@pytest.mark.parametrize("tp,pp,ep,etp,nproc,extra", [
    pytest.param(1, 1, 2, None, 4, ("--dist-opt",), id="EP2xDP4-distopt"),
    # Sequence-parallel (megatron trains MoE under TP only so); the actor keeps megatron's output layer (the
    # logits path), the reference policy the fused one.
    pytest.param(2, 1, 2, None, 4, ("--logits-output",), id="EP2xTP2"),
    pytest.param(1, 2, 2, None, 4, (), id="EP2xPP2"),
])
def test_qwen3_moe_matches_hf(qwen3_moe, tmp_path, tp, pp, ep, etp, nproc, extra):
    result = run_moe_parity(qwen3_moe, tmp_path, tp, pp, ep, etp, nproc, extra)
    for replica in result["metrics"]:  # dropless routing over a random router: every slot kept, imbalanced
        assert replica["actor/moe/dropped_token_fraction"][0] == pytest.approx(0.0, abs=1e-12)
        assert 1.0 < replica["actor/moe/load_max_over_mean"][0] <= 8 / 2
        assert replica["actor/moe/load_max_over_mean"][0] == max(
            replica[f"actor/moe/load_max_over_mean/layer_{i}"][0] for i in range(2))


def test_qwen2_moe_shared_expert_with_expert_tp1_under_tp2(tmp_path_factory, tmp_path):
    model = make_qwen2_moe(tmp_path_factory.mktemp("tiny_qwen2_moe"))
    run_moe_parity(model, tmp_path, 2, 1, 2, 1, 4)


def forced_routing(model, routes):
    """``model`` (an HF Qwen3-MoE) routing every token to ``routes`` [B, S, layers, k] instead of its own top-k;
    the gate weights are its softmax's, renormalized over the given experts as norm_topk_prob says."""
    import torch.nn.functional as F

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


def test_replayed_routes_are_what_every_pass_routes_by(qwen3_moe, tmp_path, monkeypatch):
    """Routes given with the batch (random experts, not the model's choice) are replayed at TP2 x PP2 x EP2
    (sequence-parallel slices, each stage its own layers, experts across ranks): log-probs, the loss, the
    gradient norm and the weights after the step equal HF's model forced to the same routes, to 1e-5."""
    import test_actor_parity

    batch, train = make_inputs(qwen3_moe)
    b = batch.batch
    g = torch.Generator().manual_seed(5)
    routes = torch.rand(*b["input_ids"].shape, 2, 8, generator=g).topk(2, -1).indices  # [B, S, layers, k]
    batch.batch["routed_experts"] = routes
    torch.save({"batch": batch, "train": train}, tmp_path / "inputs.pt")
    args = [str(qwen3_moe), str(tmp_path), "--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1",
            "--temperature", str(TEMPERATURE)]
    proc = run_torchrun(TESTS / "megatron" / "parity_program.py", args, 4, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)

    monkeypatch.setattr(test_actor_parity, "hf_model", lambda path: forced_routing(hf_model(path), routes))
    ref = reference_step(qwen3_moe, batch, train, "token-mean")
    own = test_actor_parity.reference_log_probs(hf_model(qwen3_moe), batch)[0]
    mask = batch.batch["response_mask"].bool()
    assert (own - ref["log_probs"]).abs()[mask].max() > 0.05  # the routes are not the model's own choice
    got = result["log_probs"].batch
    torch.testing.assert_close(got["old_log_probs"][mask], ref["log_probs"][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(result["ref_log_probs"].batch["ref_log_prob"][mask], ref["log_probs"][mask],
                               atol=1e-5, rtol=0)
    for replica in result["metrics"]:
        assert replica["actor/pg_loss"][0] == pytest.approx(ref["pg_loss"], abs=1e-5)
        assert replica["actor/grad_norm"][0] == pytest.approx(ref["grad_norm"], abs=1e-5)
    after = hf_model(tmp_path / "after_step").state_dict()
    for name, expected in ref["state"].items():
        torch.testing.assert_close(after[name], expected, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
