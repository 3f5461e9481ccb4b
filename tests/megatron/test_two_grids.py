"""Two training grids in one process: an actor and a reward model on the same two processes, each at its own TP.

Each megatron engine builds its own process groups and hands them to megatron explicitly, so the
actor at TP2 and the reward model at TP1 (DP2) share the processes without sharing a grid, and the
reverse. Both are held to HF transformers in fp32: the actor's log-probs, gradient norm and weights
after one PPO step (the reference of test_actor_parity), the reward model's scores before and after
the actor's step (test_reward_model's reference).
"""

import pytest
import torch

from conftest import TESTS, run_torchrun
from test_actor_parity import LR, TEMPERATURE, hf_model, make_inputs, reference_step
from test_reward_model import hf_scores, scoring_batch
from tiny_models import make_llama


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    policy = make_llama(tmp_path_factory.mktemp("policy"))
    reward = make_llama(tmp_path_factory.mktemp("reward"), classification=True, seed=3)
    return policy, reward


@pytest.mark.parametrize("actor_tp,reward_tp", [(2, 1), (1, 2)], ids=["actorTP2-rewardTP1", "actorTP1-rewardTP2"])
def test_actor_and_reward_model_on_their_own_grids_in_the_same_processes(models, tmp_path, actor_tp, reward_tp):
    policy, reward = models
    batch, train = make_inputs(policy)
    score_batch = scoring_batch()
    torch.save({"batch": batch, "train": train, "score_batch": score_batch}, tmp_path / "inputs.pt")
    proc = run_torchrun(TESTS / "megatron" / "two_grids_program.py",
                        [str(policy), str(reward), str(tmp_path), "--actor-tp", str(actor_tp),
                         "--reward-tp", str(reward_tp), "--temperature", str(TEMPERATURE)], 2, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["layouts"] == (f"TP{actor_tp}xPP1xDP{2 // actor_tp}", f"TP{reward_tp}xPP1xDP{2 // reward_tp}")

    ref = reference_step(policy, batch, train, "token-mean")
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(result["log_probs"].batch["old_log_probs"][mask], ref["log_probs"][mask],
                               atol=1e-5, rtol=0)
    for replica in result["metrics"]:
        assert replica["actor/pg_loss"][0] == pytest.approx(ref["pg_loss"], abs=1e-5)
        assert replica["actor/grad_norm"][0] == pytest.approx(ref["grad_norm"], abs=1e-5)
        assert replica["actor/lr"][0] == pytest.approx(LR)
    after = hf_model(tmp_path / "after_step").state_dict()
    for name, expected in ref["state"].items():
        torch.testing.assert_close(after[name], expected, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")

    expected = hf_scores(reward, score_batch)
    assert expected.abs().min() > 1e-3
    for key in ("scores_before", "scores_after"):
        torch.testing.assert_close(result[key].batch["rm_scores"], expected, atol=1e-5, rtol=0, msg=key)
