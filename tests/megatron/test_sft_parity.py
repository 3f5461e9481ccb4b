"""Supervised fine-tuning on the megatron actor at TP1, TP2, PP2 and TP2xPP2 against HF transformers.

The reference is the HF model in fp32 with the loss written out here: the token mean of the negative
log-likelihood of the response tokens under the loss mask, which has holes inside responses (as an
assistant-only chat mask has) besides the right padding. Per-row NLL sums, the loss, the gradient norm
and the weights after one clipped Adam step agree to 1e-5.

In the same processes, the same step on LoRA adapters (rank 4, every linear, started from a PEFT adapter
directory with random B) against HF PEFT with torch's Adam on the adapters: NLL sums, loss, gradient norm,
the adapters after the step (the job's PEFT export) and its merged HF export agree to 1e-5; the reference
log-probs (the adapters off) are the base model's; the gradient buffers and optimizer state hold the
adapters only. The PEFT export, loaded in peft, generates the merged export's greedy tokens.
"""

import pytest
import torch

from conftest import TESTS, run_torchrun
from peft_reference import peft_with_random_b
from state_checks import assert_state_predicted
from test_actor_parity import ADAM_EPS, LR, hf_model
from tiny_models import make_llama, make_rl_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("tiny_llama_sft"))


def sft_batch():
    """Rows as the SFT data hands them over; the loss mask skips a token inside some responses."""
    batch = make_rl_batch(seed=5)
    mask = batch.batch["response_mask"].clone()
    mask[::2, 1] = 0  # a hole: attended to, not learned
    batch.batch["response_mask"] = mask
    return batch


LORA_RANK, LORA_ALPHA = 4, 8.0
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    """PEFT's adapters on every linear, B random so that they change the output and A gets a gradient."""
    peft = peft_with_random_b(hf_model(model_dir), LORA_RANK, LORA_ALPHA)
    out = tmp_path_factory.mktemp("peft_adapter")
    peft.save_pretrained(str(out))
    return out


def _peft(model_dir, adapter):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(model_dir), str(adapter), is_trainable=True)


def reference_step(model_dir, batch, adapter=None):
    """HF's step (PEFT's on the adapters of ``adapter``, the base frozen): NLL sums, loss, gradient norm and the
    state after one clipped Adam step."""
    model = hf_model(model_dir) if adapter is None else _peft(model_dir, adapter)
    b = batch.batch
    logits = model(b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    length = b["responses"].shape[1]
    log_p = torch.log_softmax(logits[:, -length - 1: -1].float(), dim=-1)
    token_log_p = log_p.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    mask = b["response_mask"].float()
    nll_sum = -(token_log_p * mask).sum(-1)
    loss = nll_sum.sum() / mask.sum()
    loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in trained)).item()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    torch.optim.Adam(trained, lr=LR, betas=(0.9, 0.999), eps=ADAM_EPS).step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    merged = None if adapter is None else {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    return {"nll_sum": nll_sum.detach(), "tokens": mask.sum(-1), "loss": loss.item(), "grad_norm": grad_norm,
            "state": state, "merged": merged}


LAYOUTS = [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 4)]


@pytest.fixture(scope="module")
def launched(model_dir, adapter_dir, tmp_path_factory):
    """(tp, pp) -> its output directory: the layouts of one process count run in one launch (TP2 and PP2 share
    theirs), each with the same batch."""
    import json

    outs = {}
    for nproc in sorted({n for _, _, n in LAYOUTS}):
        cases = []
        for tp, pp, n in LAYOUTS:
            if n == nproc:
                out = tmp_path_factory.mktemp(f"sft-TP{tp}xPP{pp}")
                torch.save(sft_batch(), out / "inputs.pt")
                cases.append({"out": str(out), "tp": tp, "pp": pp})
                outs[tp, pp] = out
        listing = tmp_path_factory.mktemp(f"sft-{nproc}-processes") / "cases.json"
        listing.write_text(json.dumps(cases))
        proc = run_torchrun(TESTS / "megatron" / "sft_program.py", [
            str(model_dir), "--cases", str(listing), "--lora", str(adapter_dir), "--lora-rank", str(LORA_RANK),
            "--lora-alpha", str(LORA_ALPHA)], nproc, timeout=500)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return outs


@pytest.mark.parametrize("tp,pp,nproc", LAYOUTS, ids=["TP1", "TP2", "PP2", "TP2xPP2"])
def test_sft_step_matches_hf_with_the_same_mask(model_dir, adapter_dir, launched, tp, pp, nproc):
    batch = sft_batch()
    tmp_path = launched[tp, pp]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["layout"] == f"TP{tp}xPP{pp}xDP{nproc // (tp * pp)}"
    ref = reference_step(model_dir, batch)
    torch.testing.assert_close(result["eval"].batch["nll_sum"], ref["nll_sum"], atol=1e-5, rtol=0)
    torch.testing.assert_close(result["eval"].batch["tokens"], ref["tokens"], atol=0, rtol=0)
    for replica in result["metrics"]:
        assert replica["sft/loss"] == [pytest.approx(ref["loss"], abs=1e-5)]
        assert replica["sft/grad_norm"] == [pytest.approx(ref["grad_norm"], abs=1e-5)]
        assert replica["sft/lr"] == [pytest.approx(LR)]
    assert ref["grad_norm"] > 1.0  # so clipping was exercised
    after = hf_model(tmp_path / "after_step").state_dict()
    before = hf_model(model_dir).state_dict()
    assert max((ref["state"][k] - before[k]).abs().max().item() for k in before) > 1e-4
    for name, expected in ref["state"].items():
        torch.testing.assert_close(after[name], expected, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    _check_lora_step(model_dir, adapter_dir, tmp_path, batch, ref, result, generate=(tp, pp) == (2, 2), tp=tp, pp=pp)


def _check_lora_step(model_dir, adapter_dir, out, batch, base, full, generate, tp, pp):
    from safetensors.torch import load_file

    result = torch.load(out / "lora_result.pt", weights_only=False)
    ref = reference_step(model_dir, batch, adapter_dir)
    torch.testing.assert_close(result["eval"].batch["nll_sum"], ref["nll_sum"], atol=1e-5, rtol=0)
    assert (result["eval"].batch["nll_sum"] - base["nll_sum"]).abs().max() > 1e-3  # the adapters change the output
    mask = batch.batch["response_mask"].float()  # the reference policy: the base, the adapters off
    torch.testing.assert_close(-(result["ref"].batch["ref_log_prob"] * mask).sum(-1), base["nll_sum"], atol=1e-5, rtol=0)
    for replica in result["metrics"]:
        assert replica["sft/loss"] == [pytest.approx(ref["loss"], abs=1e-5)]
        assert replica["sft/grad_norm"] == [pytest.approx(ref["grad_norm"], abs=1e-5)]
    assert ref["grad_norm"] > 1.0  # so clipping was exercised
    stepped = {k.replace(".default", ""): v for k, v in ref["state"].items() if "lora_" in k}
    exported = load_file(str(out / "lora_adapter" / "adapter_model.safetensors"))
    assert sorted(exported) == sorted(stepped)
    start = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert max((exported[k] - start[k]).abs().max().item() for k in start) > 1e-4  # the step moved them
    for name, want in stepped.items():
        torch.testing.assert_close(exported[name], want, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    merged = hf_model(out / "lora_merged").state_dict()
    for name, want in ref["merged"].items():
        torch.testing.assert_close(merged[name], want, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    # Only the adapters hold gradients and optimizer state: fp32 gradients, Adam's two moments.
    for lora_rank, full_rank in zip(result["state_bytes"], full["state_bytes"]):
        assert lora_rank["weights"] == full_rank["weights"] + lora_rank["gradients"]  # the adapters beside the base
        assert 0 < lora_rank["gradients"] < full_rank["gradients"] / 5
        assert 2 * lora_rank["gradients"] <= lora_rank["optimizer"] < 2 * lora_rank["gradients"] + 4096
    # and the planner predicts them to the byte
    assert_state_predicted(model_dir, result["state_bytes"], tp, pp, "fp32", trains=True, lora_rank=LORA_RANK,
                           lora_targets=LORA_TARGETS)
    if generate:  # the PEFT export in peft generates what the merged export generates
        from peft import PeftModel

        ids = batch.batch["input_ids"][1:2, 1:6]
        loaded = PeftModel.from_pretrained(hf_model(model_dir), str(out / "lora_adapter"))
        tokens = loaded.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(tokens, hf_model(out / "lora_merged").generate(input_ids=ids, max_new_tokens=8,
                                                                           do_sample=False))
