"""trainer.mode async through the CLI on Ray: the rollout on its own pool generates a stream of samples,
2 tokens per sample per call, while the actor trains; each update reaches it at the next call.

Checked on a 4-step GRPO run: every step trains on 8 whole prompt groups within the staleness bound;
weight updates interrupt samples in the middle of their responses, which finish under the new weights
(samples whose tokens span two versions); the stream's accounts balance at every step (each group drawn
is trained, dropped, or still on its way); the rollout correction is on; and the run resumed from its
step-2 checkpoint, which holds the stream, reproduces steps 3 and 4 exactly.
"""

import pytest

from test_one_step_off import JOB as ONE_STEP_OFF_JOB
from test_one_step_off import stopped_at, train
from test_train_cli import model  # noqa: F401  (a fixture)

JOB = [arg for arg in ONE_STEP_OFF_JOB if arg != "trainer.mode=one_step_off"] + [
    "trainer.mode=async", "trainer.partial_rollout_tokens=2", "trainer.max_staleness=2",
    "rollout.sampling.max_new_tokens=6"]
COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "rollout_corr/kl_k1",
            "staleness/mean", "stream/mixed_version_samples", "stream/groups_drawn", "stream/groups_ready")
ACCOUNTS = ("trained", "dropped", "pending", "in_generation", "ready")


def test_async_mode_streams_partial_rollouts_within_the_bound_and_resumes_exactly(tmp_path, model):  # noqa: F811
    whole = train(tmp_path / "whole", model, "trainer.total_steps=4", "trainer.save_every=2", job=JOB)
    assert [m["step"] for m in whole] == [1, 2, 3, 4]
    assert all(m["staleness/max"] <= 2 and m["staleness/hist/0"] + m.get("staleness/hist/1", 0)
               + m.get("staleness/hist/2", 0) == 16 for m in whole)
    assert whole[0]["staleness/max"] == 0 and max(m["staleness/max"] for m in whole) >= 1
    assert sum(m.get("stream/interrupted_samples", 0) for m in whole[1:]) > 0  # updates land mid-response
    assert sum(m["stream/mixed_version_samples"] for m in whole) > 0  # ... and those samples are trained on
    for step, m in enumerate(whole, start=1):
        assert m["stream/groups_trained"] == 8 * step
        assert m["stream/groups_drawn"] == sum(m[f"stream/groups_{k}"] for k in ACCOUNTS)
    assert all("rollout_corr/weight_mean" in m and m["weight_transfer/bytes"] > 0 for m in whole)

    stopped = stopped_at(tmp_path / "whole", 2, tmp_path / "stopped")
    resumed = train(stopped, model, "trainer.total_steps=4", "trainer.save_every=2", "trainer.resume=true", job=JOB)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for ours, theirs in zip(resumed[2:], whole[2:]):
        for key in COMPARED:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), (ours["step"], key, ours, theirs)
