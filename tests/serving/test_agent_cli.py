"""A user's agent as the environment, through the CLI: ``examples/openai_agent.yaml`` on the tiny chat model, its
agent (the plain-openai example, wrapped by ``flaky_agent``) failing, hanging and rewriting its history on
purpose. Each failure ends its own sample only, counted; a rewritten history splits a session; the batch is
padded to whole mini-batches with rows that train nothing; the step trains on the rest."""

import math
import re

import pytest

from test_train_cli import hybridflow, read_metrics, third_party_lines


def test_a_user_agent_trains_two_steps_and_its_failures_are_its_own(tmp_path):
    proc = hybridflow("train", "--config", "examples/openai_agent.yaml", f"trainer.run_dir={tmp_path}",
                      "model_path=builtin:tiny-chat", "rollout.agent.entrypoint=tests.serving.flaky_agent:agent",
                      "reward.fn=environment", "rollout.agent.session_timeout_s=15", "trainer.total_steps=3",
                      "trainer.val_every=0", "trainer.export_hf=false", "trainer.plots=false", "data.val_size=4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert third_party_lines(proc.stdout) == [], proc.stdout[-3000:]
    steps = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2, 3]
    # Each step's failures on the console: the count, and the first exception with its traceback.
    lines = proc.stdout.splitlines()
    first = [line for line in lines if re.fullmatch(
        r"\[hybridflow\] agent: 8 of 16 sessions failed \(error 4, timeout 4\); each trains nothing\. The first, row 0 "
        r"\(session step(\d)-0-[0-9a-f]{32}\): RuntimeError: the agent failed on purpose", line)]
    assert len(first) == 2, proc.stdout[-3000:]  # one a step, under an id no other process could guess
    assert "[hybridflow]     RuntimeError: the agent failed on purpose" in lines
    assert any(line.startswith("[hybridflow]       File") and "flaky_agent.py" in line for line in lines)
    # Step 3: every session raised. It says so, and skips the update, instead of diagnosing a NaN.
    assert any(line.startswith("[hybridflow] agent: 16 of 16 sessions failed (error 16)") and
               line.endswith("KeyError: 'question'") for line in lines), proc.stdout[-3000:]
    assert ("[hybridflow] step 3: nothing to train on: every agent session failed (16 of 16: error 16; the first "
            "failure is above); the critic's and the actor's updates are skipped") in lines
    assert "non-finite" not in proc.stdout and steps[2]["training/nothing_to_train"] == 1.0
    assert "actor/pg_loss" not in steps[2] and steps[2]["agent/error"] == 16
    for s in steps[:2]:  # 4 prompts x 4 samples: a quarter raise, a quarter time out, half answer and split in two
        assert s["agent/sessions"] == 16 and s["agent/error"] == 4 and s["agent/timeout"] == 4
        assert s["agent/trajectory_splits"] == 8 and s["agent/samples"] == 8 * 2 + 8
        assert s["agent/padding_samples"] == 8  # 24 rows, padded to two mini-batches of 16
        assert s["agent/requests_per_session"] >= 1.0
        assert 5.0 <= s["timing_s/gen"] < 60  # the hung agents end at their 5 s timeout, not the step
        assert math.isfinite(s["actor/pg_loss"]) and s["actor/grad_norm"] > 0  # rewards 1 and 0 in each group


@pytest.mark.parametrize("mode", ["async"])  # one_step_off: the same calls (run by hand: staleness 0, 1, 1)
def test_a_user_agent_trains_off_policy_with_the_rollout_serving_on_its_own_pool(tmp_path, mode):
    """The server on the rollout's own pool (Ray), generating while the actor trains. one_step_off: each step's
    sessions are served for one call, on the weights from before the previous update. async: the replicas
    serve across steps and take each update in flight; groups start while they can be trained within
    max_staleness; the dump's per-token versions are the trainer's."""
    import json

    dump = tmp_path / "samples"
    proc = hybridflow("train", "--config", "examples/openai_agent.yaml", f"trainer.run_dir={tmp_path}",
                      "model_path=builtin:tiny-chat", "rollout.agent.entrypoint=tests.serving.parity_agent:agent",
                      "reward.fn=environment", f"trainer.mode={mode}", "trainer.max_staleness=1",
                      "trainer.launcher=ray", "trainer.placement={rollout: 1}", "rollout.server_update=pause",
                      "data.batch_size=2", "rollout.sampling.n=2", "ppo.ppo_mini_batch_size=4",
                      "rollout.sampling.max_new_tokens=16", "trainer.total_steps=3", "trainer.val_every=3",
                      "data.val_size=2", f"trainer.rollout_data_dir={dump}", "trainer.export_hf=false",
                      "trainer.plots=false")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    steps = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["staleness/max"] <= 1 and s["agent/sessions"] == 4 for s in steps)
    assert steps[1]["staleness/max"] == 1  # step 2 trains samples generated under version 0
    assert "val/reward/mean" in steps[2]  # validation while the rollout's pool is generating or serving
    assert any(s["actor/grad_norm"] > 0 for s in steps)  # the parity rewards differ within groups
    if mode == "one_step_off":
        assert [s["staleness/mean"] for s in steps] == [0.0, 1.0, 1.0]
        return
    for s in steps:  # two steps' groups at most are running or ready when a step takes its two
        assert s["stream/groups_trained"] == 2 * s["step"] and s["stream/groups_drawn"] >= 2 * s["step"] + 2
    assert [s["stream/weight_updates"] for s in steps] == [0, 1, 2]  # each update taken in flight, none restarted
    for step in (1, 2, 3):
        for line in map(json.loads, (dump / f"{step}.jsonl").read_text().splitlines()):
            sampled = [v for v, m in zip(line["token_versions"], line["response_mask"]) if m]
            assert all(v == -1 for v, m in zip(line["token_versions"], line["response_mask"]) if not m)
            if sampled:  # the engine's tokens carry the trainer's versions, each from the sample's oldest on
                assert line["policy_version"] == min(sampled) and max(sampled) <= step - 1
                assert step - 1 - line["policy_version"] <= 1
