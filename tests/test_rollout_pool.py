"""A rollout on a pool of its own (``trainer.placement.rollout``), fed across pools by the actor, on Ray.

The same GRPO job runs twice through the CLI: colocated (generation resharded in place on the actor's
two processes) and disaggregated (generation on two processes of its own, weights sent across pools
after every update). Both have two generation replicas at TP1 and the same seeds, and the transfer is
bit-exact, so every training and validation metric must agree; the transfer's metrics must show each
generation rank receiving exactly its shard.
"""

import re

import pytest

from test_train_cli import hybridflow, model, read_metrics  # noqa: F401  (model: a fixture)

JOB = ["--config", "examples/ppo_tiny.yaml", "algorithm.name=grpo", "rollout.sampling.n=2", "trainer.launcher=ray",
       "trainer.nproc=2", "actor.engine.tensor_parallel=2", "actor.engine.pipeline_parallel=1",
       "actor.engine.precision=fp32", "actor.engine.micro_batch_size=4", "data.batch_size=8",
       "ppo.ppo_mini_batch_size=16", "ppo.ppo_epochs=1", "trainer.total_steps=2", "trainer.val_every=2",
       "trainer.save_every=0", "trainer.logger=[jsonl]", "trainer.export_hf=false", "trainer.plots=false",
       "data.train_size=64", "data.val_size=8"]
SAME = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
        "rollout/logprob_diff_max", "val/reward/mean", "val/response_length/mean")


def test_a_rollout_on_its_own_pool_trains_exactly_as_a_colocated_one(tmp_path, model):  # noqa: F811
    runs = {}
    for name, extra in (("colocated", []), ("separate", ["trainer.placement={rollout: 2}"])):
        proc = hybridflow("train", *JOB, f"model_path={model}", f"trainer.run_dir={tmp_path / name}", *extra)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
        runs[name] = (read_metrics(tmp_path / name), proc.stderr)
    colocated, separate = runs["colocated"][0], runs["separate"][0]
    assert [m["step"] for m in separate] == [m["step"] for m in colocated] == [1, 2]
    for ours, theirs in zip(separate, colocated):
        for key in SAME:
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), (key, ours, theirs)
    assert "val/reward/mean" in separate[-1]
    # The transfer: every generation rank received exactly its shard (here TP1: the whole model), once a step.
    for step in separate:
        assert step["weight_transfer/bytes"] == step["weight_transfer/bound_bytes"] > 0
        assert step["timing_s/weight_transfer"] > 0 and "reshard/bytes_received" not in step
    assert "weight_transfer/bytes" not in colocated[0]
    stated = re.search(r"rollout on its own pool \(2 processes, genTP1xPP1 x 2 replicas\) fed by the actor's "
                       r"TP2xPP1xDP1: busiest link: p2p (\d+), broadcast (\d+) \(units of segment_bytes\); (\w+) chosen",
                       runs["separate"][1])
    assert stated, runs["separate"][1][-3000:]
    p2p, broadcast, chosen = int(stated[1]), int(stated[2]), stated[3]
    assert chosen == ("p2p" if p2p <= broadcast else "broadcast")
