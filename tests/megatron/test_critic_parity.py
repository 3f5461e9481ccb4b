"""The megatron critic (scalar value head) against HF's sequence-classification model (on two processes also with
each sequence split over both, CP2, rows packed); in the same processes, a
LoRA critic (rank 4 on every linear, the value head trained beside the adapters) against PEFT's SEQ_CLS model
(its ``score`` in ``modules_to_save``): values, loss, gradient norm and the merged model after one clipped Adam
step agree to 1e-5, and the PEFT export (adapters and head) loads in peft and gives the stepped values."""

import pytest
import torch

from conftest import TESTS, run_torchrun
from peft_reference import peft_with_random_b
from state_checks import assert_state_predicted
from tiny_models import make_llama, make_rl_batch
from workers import DataProto

CLIP_VALUE, LR, ADAM_EPS = 0.2, 1e-3, 1e-4


@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("tiny_critic"), classification=True, seed=1)


@pytest.fixture(scope="module")
def critic_adapter(critic_dir, tmp_path_factory):
    """PEFT's SEQ_CLS adapters on every linear, B random; the score head in modules_to_save, as it starts."""
    peft = peft_with_random_b(hf_critic(critic_dir), 4, 8.0, task_type="SEQ_CLS")
    out = tmp_path_factory.mktemp("critic_adapter")
    peft.save_pretrained(str(out))
    return out


def _value_step(model, batch, train, params):
    """The clipped value loss of ``model`` on ``batch`` (mask-mean), backward, clip and one Adam step on
    ``params``; returns values before the step, loss, clip fraction and gradient norm."""
    mask = batch.batch["response_mask"]
    values = reference_values(model, batch)
    old, returns = train.batch["values"], train.batch["returns"]
    clipped = old + (values - old).clamp(-CLIP_VALUE, CLIP_VALUE)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    loss = (per_token * mask).sum() / mask.sum()
    clipfrac = (((clipped - returns) ** 2 > (values - returns) ** 2).float() * mask).sum() / mask.sum()
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.optim.Adam(params, lr=LR, eps=ADAM_EPS).step()
    return values.detach(), loss.item(), clipfrac.item(), grad_norm


def hf_critic(path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def reference_values(model, batch):
    b = batch.batch
    hidden = model.model(b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).last_hidden_state
    length = b["responses"].shape[1]
    return model.score(hidden)[:, -length - 1 : -1, 0]


# The engine under the critic is the actor's, held to HF at TP1, TP2, PP2, DP2 and TP2xPP2 in
# test_actor_parity.py; here the value head and value loss at one layout of each kind of split.
@pytest.mark.parametrize("tp,pp,nproc", [(1, 1, 1), (1, 1, 2), (2, 2, 4)], ids=["TP1", "DP2", "TP2xPP2"])
def test_critic_matches_hf_reference(critic_dir, critic_adapter, tmp_path, tp, pp, nproc):
    batch = make_rl_batch(seed=4)
    mask = batch.batch["response_mask"]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        values0 = reference_values(hf_critic(critic_dir), batch)
    train = DataProto({
        "values": (values0 + 0.3 * torch.randn(values0.shape, generator=g)) * mask,  # the rollout-time values
        "returns": torch.randn(values0.shape, generator=g) * mask,
    })
    torch.save({"batch": batch, "train": train}, tmp_path / "inputs.pt")
    # on two processes, also a critic with each sequence split over both (CP2, rows packed)
    cp = ["--context-parallel", "2"] if (tp, pp, nproc) == (1, 1, 2) else []
    proc = run_torchrun(TESTS / "megatron" / "parity_program.py",
                        [str(critic_dir), str(tmp_path), "--tp", str(tp), "--pp", str(pp), "--role", "critic",
                         "--lora", str(critic_adapter), *cp], nproc, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert_state_predicted(critic_dir, result["state_bytes"], tp, pp, "fp32", trains=True)  # the value head's too

    model = hf_critic(critic_dir)
    _, loss, clipfrac, grad_norm = _value_step(model, batch, train, list(model.parameters()))

    m = mask.bool()
    results = [result] + ([torch.load(tmp_path / "cp_result.pt", weights_only=False)] if cp else [])
    for got, stepped in zip(results, ("after_step", "cp_after_step")):
        torch.testing.assert_close(got["values"].batch["values"][m], values0[m], atol=1e-5, rtol=0)
        for replica in got["metrics"]:
            assert replica["critic/vf_loss"][0] == pytest.approx(loss, abs=1e-5)
            assert replica["critic/vf_clipfrac"][0] == pytest.approx(clipfrac, abs=1e-6)
            assert replica["critic/grad_norm"][0] == pytest.approx(grad_norm, abs=1e-5)
        after = hf_critic(tmp_path / stepped).state_dict()
        for name, expected in model.state_dict().items():
            torch.testing.assert_close(after[name], expected, atol=1e-5, rtol=0, msg=lambda msg, n=name: f"{n}: {msg}")
    assert 0 < clipfrac < 1
    assert not cp or results[1]["layout"] == "TP1xCP2xPP1xDP1"
    _check_lora_critic(critic_dir, critic_adapter, tmp_path, batch, train)


def _check_lora_critic(critic_dir, adapter, out, batch, train):
    from peft import PeftModel

    result = torch.load(out / "lora_result.pt", weights_only=False)
    model = PeftModel.from_pretrained(hf_critic(critic_dir), str(adapter), is_trainable=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    values, loss, clipfrac, grad_norm = _value_step(model.get_base_model(), batch, train, trained)
    m = batch.batch["response_mask"].bool()
    torch.testing.assert_close(result["values"].batch["values"][m], values[m], atol=1e-5, rtol=0)
    for replica in result["metrics"]:
        assert replica["critic/vf_loss"][0] == pytest.approx(loss, abs=1e-5)
        assert replica["critic/vf_clipfrac"][0] == pytest.approx(clipfrac, abs=1e-6)
        assert replica["critic/grad_norm"][0] == pytest.approx(grad_norm, abs=1e-5)
    with torch.no_grad():  # the PEFT export (adapters and head) gives the stepped model's values
        stepped = reference_values(model.get_base_model(), batch)
        loaded = PeftModel.from_pretrained(hf_critic(critic_dir), str(out / "lora_adapter"))
        exported = reference_values(loaded.get_base_model(), batch)
    torch.testing.assert_close(exported[m], stepped[m], atol=1e-5, rtol=0)
    merged = hf_critic(out / "lora_merged").state_dict()
    for name, expected in model.merge_and_unload().state_dict().items():
        torch.testing.assert_close(merged[name], expected, atol=1e-5, rtol=0, msg=lambda msg, n=name: f"{n}: {msg}")
    before = hf_critic(critic_dir).state_dict()["score.weight"]
    assert (merged["score.weight"] - before).abs().max() > 1e-4  # the head trained
