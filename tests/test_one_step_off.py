"""trainer.mode one_step_off through the CLI on Ray: the rollout on its own pool generates step k+1 while
step k trains.

Checked: step 1 trains on fresh samples and every later step on samples exactly one update stale
(the staleness metrics); the rollout correction is on by default off the on-policy path and sees the
staleness (a KL between the rollout's and the trainer's log-probs that is 0 on step 1's fresh samples,
up to kernel rounding, and clearly not after); and the run resumed from its step-2 checkpoint reproduces
its own step 3 exactly, since the checkpoint holds the batch generated ahead.

The job has a teacher (controller.rl.teacher), the model's own first weights, as a KL term
(``algorithm.teacher_kl_coef``), on a pool of its own (one process, TP1): it scores one-step-off batches too, at
the same time as the actor's old log-probs, its reverse KL to the student is 0 where the student still has those
weights (step 1; TP1 against the actor's TP2, fp32 rounding) and not after, and a resumed run loads it again like
any role.
"""

import shutil

import pytest

from test_train_cli import hybridflow, model, read_metrics  # noqa: F401  (model: a fixture)

JOB = ["--config", "examples/ppo_tiny.yaml", "algorithm.name=grpo", "rollout.sampling.n=2", "trainer.launcher=ray",
       "trainer.nproc=2", "actor.engine.tensor_parallel=2", "actor.engine.pipeline_parallel=1",
       "actor.engine.precision=fp32", "actor.engine.micro_batch_size=4", "data.batch_size=8",
       "ppo.ppo_mini_batch_size=16", "ppo.ppo_epochs=1", "actor.optim.lr=2e-2", "rollout.engine=megatron",
       "trainer.placement={rollout: 2}", "trainer.mode=one_step_off", "trainer.val_every=0",
       "trainer.logger=[jsonl]", "trainer.export_hf=false", "trainer.plots=false", "data.train_size=64",
       "data.val_size=8"]
COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
            "rollout_corr/kl_k1", "staleness/mean", "actor/opd/reverse_kl", "actor/teacher_kl_loss")


def with_teacher(model: str) -> list[str]:
    """The model's first weights as a teacher KL term, on a pool of its own (TP1)."""
    return [f"teacher.model_path={model}", "algorithm.teacher_kl_coef=0.05",
            "trainer.placement={rollout: 2, teacher: 1}", "teacher.engine={precision: fp32, micro_batch_size: 8}"]


def train(run_dir, model, *extra, job=JOB):  # noqa: F811
    proc = hybridflow("train", *job, f"model_path={model}", f"trainer.run_dir={run_dir}", *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return read_metrics(run_dir)


def stopped_at(run_dir, step: int, copy):
    """A copy of ``run_dir`` as a run stopped right after saving ``step``: later checkpoints gone."""
    shutil.copytree(run_dir, copy)
    for later in copy.glob("checkpoints/*/step_*"):
        if int(later.name.removeprefix("step_")[:8]) > step:
            shutil.rmtree(later) if later.is_dir() else later.unlink()
    (copy / "checkpoints" / "trainer" / "latest").write_text(f"step_{step:08d}.json")
    return copy


def test_one_step_off_trains_one_update_stale_and_resumes_exactly(tmp_path, model):  # noqa: F811
    whole = train(tmp_path / "whole", model, *with_teacher(model), "trainer.total_steps=3", "trainer.save_every=2")
    assert [m["step"] for m in whole] == [1, 2, 3]
    assert [m["staleness/mean"] for m in whole] == [0.0, 1.0, 1.0]
    assert [m["staleness/max"] for m in whole] == [0.0, 1.0, 1.0]
    assert all(m["staleness/dropped"] == 0 and m["staleness/hist/0"] + m.get("staleness/hist/1", 0) == 16
               for m in whole)
    assert all("rollout_corr/weight_mean" in m for m in whole)  # truncated IS: on by default off-policy
    assert abs(whole[0]["rollout_corr/kl_k1"]) < 1e-5 < abs(whole[1]["rollout_corr/kl_k1"])
    assert all(m["weight_transfer/bytes"] > 0 for m in whole)
    reverse_kl = [m["actor/opd/reverse_kl"] for m in whole]  # the teacher is the student's first weights
    assert abs(reverse_kl[0]) < 1e-6 < min(abs(v) for v in reverse_kl[1:]), reverse_kl
    for m in whole:  # its pool works beside the default pool: both phases start before either ends
        teacher = [m[f"timing_s/phase/teacher/teacher/{e}"] for e in ("start", "end")]
        old = [m[f"timing_s/phase/default/old_log_prob/{e}"] for e in ("start", "end")]
        assert teacher[0] < old[1] and old[0] < teacher[1], (teacher, old)
    # Step 3's batch was collected by the step-2 checkpoint, so only steps 1 and 2 waited for theirs.
    assert ["timing_s/wait_rollout" in m for m in whole] == [True, True, False]

    stopped = stopped_at(tmp_path / "whole", 2, tmp_path / "stopped")
    resumed = train(stopped, model, *with_teacher(model), "trainer.total_steps=3", "trainer.save_every=2",
                    "trainer.resume=true")
    assert [m["step"] for m in resumed] == [1, 2, 3]
    for ours, theirs in zip(resumed, whole):
        for key in COMPARED:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), (ours["step"], key, ours, theirs)
