"""A non-finite loss, through the CLI (torchrun, 2 processes, the actor at DP2): GRPO whose advantages turn NaN
on one token of the last sample (DP rank 1's last micro-batch) at steps 2, 4 and 5, with trainer.max_bad_steps 2.

Checked against the run's own checkpoints (one per step, read back whole): a skipped step leaves the weights,
Adam's moments and the LR schedule exactly as the step before left them, on both DP ranks' shards; the step
between trains; the console names the rank and the micro-batch; two bad steps in a row stop the run (exit 3),
naming the first, and its last checkpoint is the one before."""

import json
import os
import tempfile

import torch

from test_train_cli import hybridflow, model  # noqa: F401  (model: a fixture)

JOB = ["--config", "examples/ppo_tiny.yaml", "algorithm.name=tests.faults.nan_advantages:NaNAdvantages",
       "rollout.sampling.n=2", "trainer.nproc=2", "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1",
       "actor.engine.precision=fp32", "actor.engine.micro_batch_size=4", "data.batch_size=8",
       "ppo.ppo_mini_batch_size=16", "ppo.ppo_epochs=1", "rollout.engine=megatron", "trainer.total_steps=6",
       "trainer.save_every=1", "trainer.val_every=0", "trainer.max_bad_steps=2", "trainer.logger=[jsonl]",
       "trainer.export_hf=false", "trainer.plots=false", "data.train_size=64", "data.val_size=8"]


def checkpoint(run_dir, step: int) -> dict:
    """The actor's checkpoint at ``step`` read back whole (every rank's shards: weights and Adam's moments),
    and its LR schedule."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = run_dir / "checkpoints" / "actor" / f"step_{step:08d}"
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(str(directory), os.path.join(scratch, "whole.pt"))
        whole = torch.load(os.path.join(scratch, "whole.pt"), weights_only=False)
    flat: dict = {}

    def walk(value, prefix):
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            flat[prefix[:-1]] = value

    walk(whole, "")
    flat["scheduler.num_steps"] = torch.load(directory / "extra.pt", weights_only=False)["scheduler"]["num_steps"]
    return flat


def same(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.exp_avg") for k in a)
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_a_non_finite_loss_skips_the_step_on_every_rank_and_bad_steps_in_a_row_stop_the_run(tmp_path, model):  # noqa: F811
    env = os.environ.get("HYBRIDFLOW_TEST_NAN_STEPS")
    os.environ["HYBRIDFLOW_TEST_NAN_STEPS"] = "2,4,5"
    try:
        proc = hybridflow("train", *JOB, f"model_path={model}", f"trainer.run_dir={tmp_path}")
    finally:
        os.environ.pop("HYBRIDFLOW_TEST_NAN_STEPS") if env is None else os.environ.update(
            HYBRIDFLOW_TEST_NAN_STEPS=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-5000:]
    assert ("hybridflow train: stopped: 2 steps in a row skipped their optimizer steps on a non-finite loss or "
            "gradient, the first at step 4 (steps [4, 5]") in out
    assert "actor update: mini-batch 0: non-finite pg_loss=nan on DP rank 1, micro-batch 1" in out
    assert "[hybridflow] step 2: the actor skipped its optimizer step" in out
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(s["step"], s["actor/skipped"]) for s in steps] == [(1, 0.0), (2, 1.0), (3, 0.0), (4, 1.0)]
    assert steps[1]["actor/grad_norm"] is None and steps[2]["actor/grad_norm"] is not None  # NaN: logged as null
    saved = {step: checkpoint(tmp_path, step) for step in (1, 2, 3, 4)}
    assert not (tmp_path / "checkpoints" / "actor" / "step_00000005").exists()  # the stop saved nothing more
    assert same(saved[1], saved[2]) and same(saved[3], saved[4])  # skipped: exactly the state before
    assert not same(saved[2], saved[3]) and saved[3]["scheduler.num_steps"] == 2  # the step between trained
