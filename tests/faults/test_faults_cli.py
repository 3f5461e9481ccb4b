"""Faults through the CLI (torchrun, 2 processes, the actor at DP2, fp32, the megatron rollout), each checked
against the run's own checkpoints (one per step, read back whole).

- A non-finite loss: GRPO whose advantages turn NaN on one token of the last sample (DP rank 1's last
  micro-batch) at steps 2, 4 and 5, with trainer.max_bad_steps 2. A skipped step leaves the weights, Adam's
  moments and the LR schedule exactly as the step before left them, on both DP ranks' shards; the step
  between trains; the console names the rank and the micro-batch; two bad steps in a row stop the run
  (exit 3), naming the first, and its last checkpoint is the one before.
- Damaged checkpoints and a full disk: that run, copied onto a tmpfs with room for all of it and 3 MiB more,
  its step-4 checkpoint with a shard cut short and its step-3 one with a bit flipped. A resume names both
  files, passes over both, and resumes from step 2: its step 3 is the first run's step 3 exactly. Saving
  step 3 then fills the disk: the run stops (exit 3) saying the filesystem is full, removes the partial
  write, and step 2 still verifies.
- A stopped rank, then a killed one, with trainer.max_restarts 2: SIGSTOP on rank 1 after step 1 (with
  trainer.hang_timeout_s 8) is reported within the bound; torchrun starts again, resumed; SIGKILL on the new
  rank 1 after step 2 is found at once and restarted past too. The run's metrics equal the first run's exactly.
"""

import json
import os
import re
import shutil
import subprocess

import pytest
import torch

from test_train_cli import checkpoint, hybridflow, model  # noqa: F401  (model: a fixture)

JOB = ["--config", "examples/ppo_tiny.yaml", "algorithm.name=tests.faults.nan_advantages:NaNAdvantages",
       "rollout.sampling.n=2", "trainer.nproc=2", "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1",
       "actor.engine.precision=fp32", "actor.engine.micro_batch_size=4", "data.batch_size=8",
       "ppo.ppo_mini_batch_size=16", "ppo.ppo_epochs=1", "rollout.engine=megatron", "trainer.total_steps=6",
       "trainer.save_every=1", "trainer.val_every=0", "trainer.max_bad_steps=2", "trainer.logger=[jsonl]",
       "trainer.export_hf=false", "trainer.plots=false", "data.train_size=64", "data.val_size=8"]

# What a run measures rather than computes: left out where two runs are compared.
TIMED = ("timing_s/", "perf/", "rollout/tokens_per_s", "job/")


def same(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.exp_avg") for k in a)
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory, model):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("nan_run")
    env = os.environ.get("HYBRIDFLOW_TEST_NAN_STEPS")
    os.environ["HYBRIDFLOW_TEST_NAN_STEPS"] = "2,4,5"
    try:
        proc = hybridflow("train", *JOB, f"model_path={model}", f"trainer.run_dir={run_dir}")
    finally:
        os.environ.pop("HYBRIDFLOW_TEST_NAN_STEPS") if env is None else os.environ.update(
            HYBRIDFLOW_TEST_NAN_STEPS=env)
    return proc, run_dir


def test_a_non_finite_loss_skips_the_step_on_every_rank_and_bad_steps_in_a_row_stop_the_run(nan_run):
    proc, tmp_path = nan_run
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


def test_damaged_checkpoints_are_passed_over_and_a_full_disk_during_a_save_loses_nothing(nan_run, tmp_path,
                                                                                       model):  # noqa: F811
    """The first run, copied onto a tmpfs with room for everything but one more checkpoint, its step-4
    checkpoint cut short and its step-3 one with a flipped bit; resumed to step 3 (the NaN off)."""
    from controller.rl.trainer_checkpoint import latest_trainer_state

    first, run_dir = nan_run
    disk = tmp_path / "disk"
    disk.mkdir()
    used = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={used + (3 << 20)}", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here to fill: {mounted.stderr.strip()}")
    try:
        run = disk / "run"
        shutil.copytree(run_dir, run)
        actor = run / "checkpoints" / "actor"
        torn = actor / "step_00000004" / "__0_1.distcp"
        whole = torn.stat().st_size
        torn.write_bytes(torn.read_bytes()[: whole // 2])  # a copy cut short
        flipped = actor / "step_00000003" / "__0_0.distcp"
        data = bytearray(flipped.read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit
        flipped.write_bytes(bytes(data))
        proc = hybridflow("train", *JOB, f"model_path={model}", f"trainer.run_dir={run}", "trainer.resume=true",
                          "trainer.total_steps=3")
        out = proc.stdout + proc.stderr
        assert (f"checkpoint step 4 is damaged: actor/step_00000004/__0_1.distcp: {whole // 2} bytes, {whole} "
                f"written (torn); using the previous one") in out, out[-5000:]
        assert "checkpoint step 3 is damaged: actor/step_00000003/__0_0.distcp: sha256 " in out
        assert "... written (changed); using the previous one" in out
        # Resumed from step 2, its step 3 is the first run's step 3 exactly (logged before its save) ...
        resumed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
        original = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2]
        assert resumed["step"] == original["step"] == 3
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
            assert resumed[key] == original[key], key
        # ... and its save does not fit: the run stops, the partial write is gone, step 2 still verifies.
        assert proc.returncode == 3, out[-5000:]
        root = run / "checkpoints"
        assert (f"hybridflow train: stopped: the checkpoint of step 3 could not be written under {root} (the "
                f"filesystem is full: ") in out
        assert "the newest complete checkpoint, step 2, is untouched and verifies" in out  # not 3 or 4
        assert not list(root.glob("*/.step_*.tmp"))
        assert latest_trainer_state(root, log=lambda line: None)["step"] == 2
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_stopped_rank_then_a_killed_one_are_restarted_past_and_the_run_ends_as_the_uninterrupted_one(
        nan_run, tmp_path, model):  # noqa: F811
    """The first run's job again, with trainer.max_restarts 2 and trainer.hang_timeout_s 8. SIGSTOP on rank 1
    after step 1: the hang is reported within the bound, naming rank 1, with every rank's stack in the run
    directory; torchrun starts again and resumes. Then SIGKILL on the new rank 1 after step 2: found at once,
    restarted again. The run then meets the NaN steps 4 and 5 and stops (exit 3) as the first run did: its
    metrics, one file continued across both restarts, equal the uninterrupted run's exactly."""
    import signal
    import sys

    from tools.fault_drill import Drill

    first, first_dir = nan_run
    run = tmp_path / "run"
    drill = Drill([sys.executable, "-m", "controller.cli", "train", *JOB, f"model_path={model}",
                   f"trainer.run_dir={run}", "trainer.max_restarts=2", "trainer.hang_timeout_s=8"], run,
                  env={"HYBRIDFLOW_TEST_NAN_STEPS": "2,4,5"})
    try:
        drill.wait(lambda: 1 in drill.steps(), "step 1")
        stopped = drill.rank_pid(1)
        drill.fault("hang", lambda: drill.stop(stopped), found="passed its deadline of 8 s", recovered=2)
        hang = drill.text()
        killed = drill.rank_pid(1)
        assert killed != stopped
        drill.fault("kill", lambda: os.kill(killed, signal.SIGKILL), found="restart 2 ", recovered=3)
        code = drill.finish()
    finally:
        drill.kill()
    out = drill.text()
    # The hang: found within the deadline and a little (the stacks taken, then the report), rank 1 named.
    assert drill.times["hang"]["found_s"] < 8 + 15, drill.times
    assert "never reached the collective the others wait in" in hang
    assert f"rank 1 (pid {stopped}" in hang and "stopped (its process is in state T: SIGSTOP)" in hang
    reports = list((run / "hangs").glob("*/report.txt"))
    assert len(reports) == 1
    stacks = {p.name: p.read_text() for p in reports[0].parent.glob("rank_*.txt")}
    assert sorted(stacks) == ["rank_0.txt", "rank_1.txt"] and all(stacks.values())
    # Two restarts, each saying why; the killed rank named at once (by rank 0, or by torchrun's agent, which
    # stops rank 0 as soon as it sees a rank die).
    assert re.search(r"\[hybridflow\] restart 1 \(at most 2 within 3600 s\) after HangError: \w+\.\w+ passed its "
                     r"deadline of 8 s", out), out[-5000:]
    assert re.search(r"\[hybridflow\] restart 2 \(at most 2 within 3600 s\) after (WorkerDiedError: worker rank 1 "
                     rf"died|local rank 1 \(pid {killed}\) ended by SIGKILL)", out), out[-5000:]
    assert drill.times["kill"]["found_s"] < 15, drill.times
    assert out.count("[hybridflow] resumed at step ") == 2
    restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert restarts[0]["cause"].startswith("HangError: ") and "rank 1" in restarts[1]["cause"]
    # The same end as the uninterrupted run, at the same step, and the same numbers at every step.
    assert code == first.returncode == 3, out[-5000:]
    assert "the first at step 4 (steps [4, 5]" in out
    ours, theirs = drill.records(), [json.loads(line) for line in (first_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in ours] == [s["step"] for s in theirs] == [1, 2, 3, 4]
    for mine, original in zip(ours, theirs):
        compared = [k for k in original if not k.startswith(TIMED)]
        assert len(compared) > 20 and all(mine[k] == original[k] for k in compared), (mine, original)
    assert ours[-1]["job/restarts"] == 2.0 and ours[-1]["job/data_parallel"] == 2.0  # each record says how many
