"""Old log-probs from the update's own forward (``algorithm.old_log_prob_source: auto`` when on-policy) against
the recompute path, on real actors over DP2 (gloo), and the decision rule itself."""

import pytest
import torch

from conftest import TESTS, run_torchrun
from tiny_models import make_llama
from workers.rollout.agreement import logprob_agreement, old_log_probs_from_update


@pytest.mark.parametrize("source,epochs,mini,sequences,before,expected", [
    ("auto", 1, 32, 32, False, True),  # one epoch over one mini-batch: on-policy
    ("auto", 2, 32, 32, False, False),  # a second epoch sees weights the first one moved
    ("auto", 1, 16, 32, False, False),  # the second mini-batch likewise
    ("auto", 1, 32, 32, True, False),  # a KL penalty in the reward reads them before the update
    ("recompute", 1, 32, 32, False, False),
    ("rollout", 1, 32, 32, False, False),
])
def test_the_update_gives_the_old_log_probs_only_when_provably_on_policy(source, epochs, mini, sequences, before, expected):
    assert old_log_probs_from_update(source, epochs, mini, sequences, before) is expected


def test_an_unknown_source_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"'update' is not one of \('auto', 'recompute', 'rollout'\)"):
        old_log_probs_from_update("update", 1, 8, 8, False)


def test_old_log_probs_from_the_update_give_the_numbers_of_the_recompute_path(tmp_path):
    model = make_llama(tmp_path / "model")
    proc = run_torchrun(TESTS / "megatron" / "old_log_prob_program.py", [str(model), str(tmp_path)], 2, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    batch = result["batch"].batch
    for precision in ("fp32", "bf16"):
        r = result[precision]
        for recompute, from_update in zip(r["recompute"], r["from_update"]):  # one dict per DP replica
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
                assert from_update[key] == pytest.approx(recompute[key], abs=1e-6), (precision, key)
            assert from_update["actor/ppo_kl"] == [0.0] and from_update["actor/pg_clipfrac"] == [0.0]  # ratio exactly 1
            # The rollout/train agreement comes back from the update, equal to the one computed from the pass.
            expected = logprob_agreement(batch["rollout_log_probs"], r["old_log_probs"], batch["response_mask"])
            assert from_update["actor/rollout_logprob_diff_max"] == [pytest.approx(expected["rollout/logprob_diff_max"], abs=1e-6)]
            assert from_update["actor/rollout_logprob_diff_mean"] == [pytest.approx(expected["rollout/logprob_diff_mean"], abs=1e-6)]
        recompute_weights, update_weights = r["weights"]
        assert recompute_weights.keys() == update_weights.keys()
        for name, tensor in recompute_weights.items():
            torch.testing.assert_close(update_weights[name], tensor, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{precision} {n}: {m}")
    assert result["bf16"]["weights"][0]["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    assert "ppo_epochs 1" in result["refusal"] and "recompute them with compute_log_prob" in result["refusal"]
