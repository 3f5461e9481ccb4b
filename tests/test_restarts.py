"""Automatic restart's pure logic: which failures restart, the crash-loop bound, the resize of a job to the
healthy nodes and what it says, the bad-step count and the logger's per-record fields (no process group)."""

import json
from dataclasses import replace

import pytest

from controller.checks.trainer import trainer_problems
from controller.config import RLConfig, load_config
from controller.errors import (CallTimeoutError, ConfigError, NonFiniteTrainingError, RemoteWorkerError,
                               WorkerDiedError)
from controller.jobs.relaunch import _resize_note, data_parallel, healthy_node_count
from controller.jobs.restarts import CrashLoopError, RestartBudget, describe, restart_fields, restartable
from controller.metrics.log import MetricsLogger, read_metrics
from controller.rl.bad_steps import BadSteps
from controller.runtime.hang_watch import HangError


def test_a_lost_worker_a_hang_or_a_peers_broken_collective_restarts_a_bug_or_a_bad_config_does_not():
    assert restartable(WorkerDiedError(1, "update_actor", "its Ray actor died"))
    assert restartable(HangError("actor.update_actor passed its deadline"))
    assert restartable(CallTimeoutError([1], "generate", 5.0))
    assert restartable(RemoteWorkerError(0, "update_actor", "DistBackendError", "Traceback ...\n"))
    gloo = "Traceback ...\nRuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    assert restartable(RemoteWorkerError(0, "update_actor", "RuntimeError", gloo))
    assert not restartable(RemoteWorkerError(0, "update_actor", "ValueError", "Traceback ...\nValueError: shape"))
    assert not restartable(NonFiniteTrainingError("2 steps in a row"))
    assert not restartable(ConfigError("bad"))
    assert not restartable(KeyError("x"))
    assert describe(WorkerDiedError(1, "update_actor", "killed\nmore")) == (
        "WorkerDiedError: worker rank 1 died during 'update_actor': killed")


def test_restarts_within_the_window_are_bounded_and_the_one_past_the_bound_lists_every_failure(tmp_path):
    now = [1000.0]
    budget = RestartBudget(max_restarts=2, window_s=600, log_path=tmp_path / "restarts.jsonl", clock=lambda: now[0])
    assert budget.admit("WorkerDiedError: a") == 1
    budget.record(nnodes=[2, 1], data_parallel=[2, 1])
    now[0] += 100
    assert budget.admit("HangError: b") == 2
    now[0] += 100
    with pytest.raises(CrashLoopError) as raised:
        budget.admit("WorkerDiedError: c")
    text = str(raised.value)
    assert "3 failures within trainer.restart_window_s=600 s, more than trainer.max_restarts=2 restarts allow" in text
    assert text.index("[1] ") < text.index("WorkerDiedError: a") < text.index("[2] ") < text.index("HangError: b") \
        < text.index("[3] ") < text.index("WorkerDiedError: c")
    # Past the window the oldest restarts no longer count: a job that fails now and then goes on.
    now[0] += 1000
    assert budget.admit("WorkerDiedError: d") == 3
    records = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [(r["restart"], r["cause"]) for r in records] == [(1, "WorkerDiedError: a")]
    assert records[0]["details"] == {"nnodes": [2, 1], "data_parallel": [2, 1]} and records[0]["at"] == 1000.0
    with pytest.raises(CrashLoopError, match=r"HangError: x \(trainer.max_restarts=0: no restarts\)"):
        RestartBudget(0, 60).admit("HangError: x")
    assert restart_fields(0, 2) == {} and restart_fields(1, 2) == {"job/restarts": 1.0, "job/data_parallel": 2.0}


def test_the_restart_settings_are_checked_before_launch():
    problems = trainer_problems(replace(RLConfig().trainer, max_restarts=-1, restart_window_s=0))
    assert "trainer.max_restarts must be >= 0 (0 turns it off), got -1" in problems
    assert "trainer.restart_window_s must be a positive number of seconds, got 0" in problems
    assert any("trainer.max_restarts=1 needs a trainer.run_dir" in p
               for p in trainer_problems(replace(RLConfig().trainer, max_restarts=1, run_dir=None)))


def test_fewer_healthy_nodes_shrink_the_data_parallel_size_and_the_note_says_the_global_batch_is_kept():
    config = load_config(None, ["trainer.nnodes=2", "trainer.nproc=2", "actor.engine.tensor_parallel=2",
                                "actor.engine.pipeline_parallel=1", "actor.engine.micro_batch_size=2",
                                "ppo.ppo_mini_batch_size=8"])
    assert data_parallel(config) == 2  # 2 nodes x 2 processes / TP 2
    one_node = replace(config, trainer=replace(config.trainer, nnodes=1))
    assert data_parallel(one_node) == 1
    nodes = [{"CPU": 4.0, "GPU": 0.0}, {"CPU": 1.0, "GPU": 0.0}, {"CPU": 2.0, "GPU": 2.0}]
    assert healthy_node_count(nodes, nproc=2, gpus=False) == 2 and healthy_node_count(nodes, 2, gpus=True) == 1
    note = _resize_note(config, 2, 1, mini_batch=lambda c: c.ppo.ppo_mini_batch_size)
    # per DP rank: 8 / DP sequences a mini-batch, in micro-batches of 2: twice as many at half the size
    assert note == (" at data-parallel size 1 instead of 2: the global batch of 8 sequences is kept, 8 sequences a "
                    "rank in 4 micro-batches of 2 instead of 4 sequences a rank in 2 micro-batches of 2")
    assert _resize_note(config, 2, 2, mini_batch=lambda c: 8) == " at the same data-parallel size, 2"


def test_bad_steps_in_a_row_stop_at_the_limit_naming_the_first_and_a_step_that_trains_resets_the_count(capsys):
    bad = BadSteps(limit=2)
    assert bad.count(3, ["actor"]) == 1.0
    assert bad.count(4, []) is None  # trained: the count starts over
    assert bad.count(5, ["critic", "actor"]) == 1.0
    assert "step 5: the critic and the actor skipped their optimizer step" in capsys.readouterr().out
    with pytest.raises(NonFiniteTrainingError, match=r"2 steps in a row .* the first at step 5 \(steps \[5, 6\]"):
        bad.count(6, ["actor"])


def test_the_logger_adds_its_fields_to_every_record(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",), fields={"job/restarts": 1.0}) as logger:
        logger.log(3, {"loss": 0.5})
        logger.log(4, {"loss": 0.25, "job/restarts": 7.0})  # the job's fields win
    assert read_metrics(tmp_path) == [{"step": 3, "loss": 0.5, "job/restarts": 1.0},
                                      {"step": 4, "loss": 0.25, "job/restarts": 1.0}]



def test_a_save_that_a_lost_or_hung_worker_interrupts_goes_on_as_that_failure_not_as_a_write_error(tmp_path):
    from controller.rl.trainer_checkpoint import CheckpointWriteError, saving

    partial = tmp_path / "actor" / ".step_00000003.tmp"
    for error in (HangError("actor.save_checkpoint passed its deadline"), WorkerDiedError(1, "save_checkpoint", "x")):
        partial.mkdir(parents=True)
        with pytest.raises(type(error)):
            with saving(tmp_path, 3):
                raise error
        assert not partial.exists()  # the partial write is removed either way
    with pytest.raises(CheckpointWriteError, match="the checkpoint of step 3 could not be written"):
        with saving(tmp_path, 3):
            raise OSError("disk quota exceeded")


def test_the_drill_waits_for_the_step_after_the_one_resumed_at_wherever_the_fault_landed(tmp_path):
    """A fault that lands after step 3 was done and checkpointed: the restarted run resumes at 3 and logs 4 next.
    The drill must wait for step 4, not for a step 3 that is never logged again (it waited 300 s and failed)."""
    import json
    import sys
    import textwrap

    from tools.fault_drill import Drill

    run = tmp_path / "run"
    run.mkdir()
    program = textwrap.dedent(f"""
        import json, os, time
        from pathlib import Path
        run = Path({str(run)!r})
        def log(step):
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps({{"step": step, "x": step}}) + "\\n")
        for step in (1, 2, 3):
            log(step)
        while not (run / "fault").exists():
            time.sleep(0.05)
        print("[hybridflow] the job failed: a node was lost", flush=True)
        print("[hybridflow] resumed at step 3", flush=True)
        time.sleep(1)  # the restarted run trains its next step
        log(4)
    """)
    drill = Drill([sys.executable, "-c", program], run, deadline_s=20)
    try:
        drill.wait(lambda: 2 in drill.steps(), "step 2")
        drill.fault("node", lambda: (run / "fault").write_text("now"), found="[hybridflow] the job failed")
        assert drill.finish(timeout=20) == 0
    finally:
        drill.kill()
    assert drill.steps() == [1, 2, 3, 4] and set(drill.times["node"]) == {"found_s", "recovered_s"}
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]) == {"step": 4, "x": 4}
