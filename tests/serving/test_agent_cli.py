"""A user's agent as the environment, through the CLI: ``examples/openai_agent.yaml`` on the tiny chat model, its
agent (the plain-openai example, wrapped by ``flaky_agent``) failing, hanging and rewriting its history on
purpose. Each failure ends its own sample only, counted; a rewritten history splits a session; the batch is
padded to whole mini-batches with rows that train nothing; the step trains on the rest."""

import math

from test_train_cli import hybridflow, read_metrics, third_party_lines


def test_a_user_agent_trains_two_steps_and_its_failures_are_its_own(tmp_path):
    proc = hybridflow("train", "--config", "examples/openai_agent.yaml", f"trainer.run_dir={tmp_path}",
                      "model_path=builtin:tiny-chat", "rollout.agent.entrypoint=tests.serving.flaky_agent:agent",
                      "reward.fn=environment", "rollout.agent.session_timeout_s=3", "trainer.total_steps=2",
                      "trainer.val_every=0", "trainer.export_hf=false", "trainer.plots=false", "data.val_size=4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert third_party_lines(proc.stdout) == [], proc.stdout[-3000:]
    steps = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:  # 4 prompts x 4 samples: a quarter raise, a quarter time out, half answer and split in two
        assert s["agent/sessions"] == 16 and s["agent/error"] == 4 and s["agent/timeout"] == 4
        assert s["agent/trajectory_splits"] == 8 and s["agent/samples"] == 8 * 2 + 8
        assert s["agent/padding_samples"] == 8  # 24 rows, padded to two mini-batches of 16
        assert s["agent/requests_per_session"] >= 1.0
        assert 3.0 <= s["timing_s/gen"] < 60  # the hung agents end at their 3 s timeout, not the step
        assert math.isfinite(s["actor/pg_loss"]) and s["actor/grad_norm"] > 0  # rewards 1 and 0 in each group
