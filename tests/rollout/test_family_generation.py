"""Qwen3 (q/k norm, head_dim of its own, a padded 301-id vocabulary) and Llama 3.x (RoPE scaling with
non-default frequency bounds) end to end, in one torchrun launch of 4 ranks that the two share:

* megatron at TP2 x PP2 gives HF's fp32 logits within 1e-5, and HF's log-probs and entropies on both
  output paths (fused output layer in the actor, megatron's output layer in the probe);
* import then export is bit-exact (padded rows stripped);
* after a sync from the actor, vLLM (generation TP2) and the megatron rollout (TP2 x PP2) decode HF's
  greedy tokens.

The Qwen3 vocabulary (301 ids, odd) only fits TP2 padded: megatron pads to 512 rows (128 x TP2, 256 a
rank) and vLLM to 320 (160 a rank), so the sync must regroup the vocabulary rows between the two ranks.
"""

from pathlib import Path

import pytest
import torch
from conftest import run_torchrun
from rollout_checks import assert_greedy_matches_hf
from tiny_models import all_tensors, make_llama3, make_qwen3

from controller.models.char_tokenizer import save_char_tokenizer

PROGRAM = Path(__file__).parent / "family_program.py"
FAMILIES = {  # name: (make, vocab, make_vocab_size_divisible_by)
    "qwen3-padded-vocab": (make_qwen3, 301, 128),
    "llama3-rope-scaling": (make_llama3, 256, None),
}


def hf_outputs(model_dir, batch, prompt_length):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(batch.batch["input_ids"]).logits
    predicting = logits[:, prompt_length - 1 : -1]  # the positions that predict the response tokens
    log_probs = torch.log_softmax(predicting, -1)
    chosen = log_probs.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logits, chosen, entropy


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Both families' models, and one launch that runs each in turn (the processes start once)."""
    root = tmp_path_factory.mktemp("families")
    specs = []
    for name, (make, vocab, pad) in FAMILIES.items():
        model = save_char_tokenizer(make(root / name / "model", vocab=vocab), vocab)
        (root / "out" / name).mkdir(parents=True)
        specs.append(f"{name}={model}:{vocab}" + ("" if pad is None else f":{pad}"))
    proc = run_torchrun(PROGRAM, [str(root / "out"), *specs], nproc=4, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return root


@pytest.mark.parametrize("family", FAMILIES)
def test_family_on_megatron_tp2_pp2_and_vllm(launched, family):
    make, vocab, pad = FAMILIES[family]
    model = launched / family / "model"
    out = launched / "out" / family
    result = torch.load(out / "family.pt", weights_only=False)
    batch = result["batch"]
    prompt_length = batch.batch["input_ids"].shape[1] - batch.batch["responses"].shape[1]
    logits, log_probs, entropy = hf_outputs(model, batch, prompt_length)

    probe = result["probe"].batch
    rows = 512 if pad else vocab
    assert probe["logits"].shape == (*logits.shape[:2], rows)
    assert (probe["logits"][..., :vocab] - logits).abs().max() < 1e-5
    for name, ours in (("probe", probe["log_probs"]), ("actor", result["actor"].batch["old_log_probs"])):
        assert (ours - log_probs).abs().max() < 1e-5, name
    for name, ours in (("probe", probe["entropy"]), ("actor", result["actor"].batch["entropys"])):
        assert (ours - entropy).abs().max() < 1e-5, name  # over the real vocabulary: padding has no mass

    original, exported = all_tensors(model), all_tensors(out / "exported")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    if "qwen3" in family:
        assert original["model.embed_tokens.weight"].shape[0] == vocab and "model.layers.1.self_attn.q_norm.weight" in original

    assert_greedy_matches_hf(result["vllm_greedy"], model, 10)
    assert_greedy_matches_hf(result["megatron_greedy"], model, 10)
