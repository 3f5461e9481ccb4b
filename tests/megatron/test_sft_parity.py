"""Supervised fine-tuning on the megatron actor at TP1, TP2, PP2 and TP2xPP2 against HF transformers.

The reference is the HF model in fp32 with the loss written out here: the token mean of the negative
log-likelihood of the response tokens under the loss mask, which has holes inside responses (as an
assistant-only chat mask has) besides the right padding. Per-row NLL sums, the loss, the gradient norm
and the weights after one clipped Adam step agree to 1e-5.
"""

import pytest
import torch

from conftest import TESTS, run_torchrun
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


def reference_step(model_dir, batch):
    model = hf_model(model_dir)
    b = batch.batch
    logits = model(b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    length = b["responses"].shape[1]
    log_p = torch.log_softmax(logits[:, -length - 1: -1].float(), dim=-1)
    token_log_p = log_p.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    mask = b["response_mask"].float()
    nll_sum = -(token_log_p * mask).sum(-1)
    loss = nll_sum.sum() / mask.sum()
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=ADAM_EPS).step()
    return {"nll_sum": nll_sum.detach(), "tokens": mask.sum(-1), "loss": loss.item(), "grad_norm": grad_norm,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("tp,pp,nproc", [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 4)],
                         ids=["TP1", "TP2", "PP2", "TP2xPP2"])
def test_sft_step_matches_hf_with_the_same_mask(model_dir, tmp_path, tp, pp, nproc):
    batch = sft_batch()
    torch.save(batch, tmp_path / "inputs.pt")
    proc = run_torchrun(TESTS / "megatron" / "sft_program.py", [str(model_dir), str(tmp_path), "--tp", str(tp),
                                                                 "--pp", str(pp)], nproc, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
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
