"""The megatron RewardModel against HF's LlamaForSequenceClassification, sequence by sequence."""

import pytest
import torch
from conftest import TESTS, run_torchrun
from tiny_models import make_llama, make_rl_batch


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("tiny_rm"), classification=True, seed=3)


def scoring_batch():
    """make_rl_batch's rows (0-2 left pads, 0-3 right pads), with row 5's response emptied."""
    batch = make_rl_batch(batch_size=6, seed=7)
    b = batch.batch
    prompt_length = b["input_ids"].shape[1] - b["responses"].shape[1]
    b["response_mask"][5] = 0
    b["responses"][5] = 0
    b["attention_mask"][5, prompt_length:] = 0
    b["input_ids"][5, prompt_length:] = 0
    b["position_ids"][:] = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch


def hf_scores(model_dir, batch):
    """HF's pooled score of each row on its own, without padding."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    b = batch.batch
    scores = []
    with torch.no_grad():
        for ids, mask in zip(b["input_ids"], b["attention_mask"]):
            ids = ids[mask.bool()].unsqueeze(0)
            pooled = model(ids).logits[0, 0]
            last = model.score(model.model(ids).last_hidden_state)[0, -1, 0]
            assert pooled == last  # no id in the row is the pad id 0, so HF pools the last token
            scores.append(pooled)
    return torch.stack(scores)


# The scalar head on each kind of split (the engine under it is held to HF at every layout by the actor tests).
@pytest.mark.parametrize("tp,pp,nproc,score_key", [(2, 1, 2, "rm_scores"), (1, 2, 2, "cost_scores")], ids=["TP2", "PP2-cost"])
def test_reward_model_matches_hf(rm_dir, tmp_path, tp, pp, nproc, score_key):
    batch = scoring_batch()
    torch.save({"batch": batch}, tmp_path / "inputs.pt")
    proc = run_torchrun(TESTS / "megatron" / "reward_model_program.py",
                        [str(rm_dir), str(tmp_path), "--tp", str(tp), "--pp", str(pp), "--score-key", score_key],
                        nproc, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["layout"] == f"TP{tp}xPP{pp}xDP1"
    scored = result["scored"]
    assert set(scored.keys()) == {"token_level_scores", score_key}

    expected = hf_scores(rm_dir, batch)
    scores = scored.batch[score_key]
    assert scores.shape == (6,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert expected.abs().min() > 1e-3  # the scores are real numbers, not zeros

    # The score sits on the last valid response token; the emptied response carries none.
    token_level = scored.batch["token_level_scores"]
    lengths = batch.batch["response_mask"].sum(-1).tolist()
    assert lengths == [5, 4, 3, 2, 5, 0]
    placed = torch.zeros_like(token_level)
    for row, length in enumerate(lengths):
        if length:
            placed[row, length - 1] = scores[row]
    assert torch.equal(token_level, placed)


def test_reward_model_refuses_a_causal_lm_and_bad_score_keys(tmp_path, rm_dir):
    from workers.reward import RewardModel

    lm_dir = make_llama(tmp_path / "lm", layers=1)
    with pytest.raises(ValueError, match=r"RewardModel needs a sequence-classification checkpoint with a value head; "
                                         r".* is a LlamaForCausalLM"):
        RewardModel(str(lm_dir))
    for key in ("", "token_level_scores", None):
        with pytest.raises(ValueError, match=f"score_key must be a non-empty name other than 'token_level_scores', got {key!r}"):
            RewardModel(str(rm_dir), score_key=key)
