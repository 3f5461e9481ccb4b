"""End to end through the real CLI (`hybridflow train`) on the built-in tiny model.

Every algorithm runs end to end, the runs spread over both launchers and both
rollout engines (one process each, so the suite stays short, except PPO at the
demo's TP2 x PP2, with sequence-level TIS, and GRPO on Ray at TP2; more TP/PP
runs are in the rollout and megatron tests); the GRPO job runs again with its
rollout on a pool of its own, and must train exactly as it did colocated;
stopping a run of the demo task and resuming it must reproduce the
uninterrupted run's metrics exactly. (Learning-length runs are tools, not
tests: tools/precision_learning.py measures the demo task's reward rising in
bf16 as in fp32.)
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent

TINY = [
    "trainer.nproc=1", "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1",
    "critic.engine.tensor_parallel=1", "critic.engine.pipeline_parallel=1", "actor.engine.micro_batch_size=2",
    "critic.engine.micro_batch_size=2", "data.batch_size=4", "data.train_size=64", "data.val_size=8",
    "rollout.sampling.max_new_tokens=4", "rollout.max_prompt_length=8", "trainer.logger=[jsonl]",
    "trainer.export_hf=false", "trainer.total_steps=1", "trainer.val_every=1", "trainer.save_every=0",
    "trainer.plots=false",
]
ALGORITHMS = {
    "ppo": ["ppo.ppo_mini_batch_size=4", "critic_ppo.ppo_mini_batch_size=4"],
    # One epoch over one mini-batch: on-policy, so the old log-probs come from the update's own forward.
    "grpo": ["rollout.sampling.n=2", "ppo.ppo_mini_batch_size=8", "ppo.ppo_epochs=1"],
    "rloo": ["rollout.sampling.n=2", "ppo.ppo_mini_batch_size=8", "ppo.ppo_epochs=1"],
    "remax": ["ppo.ppo_mini_batch_size=4"],
    "reinforce_plus_plus": ["ppo.ppo_mini_batch_size=4", "algorithm.gamma=0.9"],
}


class TimedProcess(subprocess.CompletedProcess):
    """A finished run, and ``ending_s``: seconds from its last line of output (stdout or stderr) to its exit."""

    ending_s: float


def hybridflow(*args: str, timeout: float = 400, pythonpath: tuple[str, ...] = ()) -> TimedProcess:
    """``hybridflow ARGS`` run to its end, its output read line by line as it comes, to time its ending;
    ``pythonpath``: folders of the user's own modules, before the project's."""
    import threading
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(ROOT)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "controller.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
    lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
    last_line = [time.monotonic()]

    def read(name: str) -> None:
        for line in getattr(proc, name):
            lines[name].append(line)
            last_line[0] = time.monotonic()

    readers = [threading.Thread(target=read, args=(name,), daemon=True) for name in lines]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        for reader in readers:
            reader.join(30)
    done = TimedProcess(proc.args, code, "".join(lines["stdout"]), "".join(lines["stderr"]))
    done.ending_s = max(0.0, time.monotonic() - last_line[0])
    return done


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The built-in tiny model, made once for every run here (a run would otherwise write its own)."""
    from controller.models.builtin import resolve_model_path

    return resolve_model_path("builtin:tiny-arithmetic", tmp_path_factory.mktemp("model"))


def third_party_lines(stdout: str) -> list[str]:
    """Lines of a run's stdout that are not hybridflow's own and carry a log level (workers.console filters them)."""
    return [line for line in stdout.splitlines()
            if not line.startswith(("[hybridflow]", "step ")) and re.search(r"\b(WARNING|INFO|DEBUG|Warning)\b", line)]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# (algorithm, launcher): PPO on both; every other algorithm on one of them (the estimators are pure
# functions, tested by hand in test_advantages.py; the launchers and engines are what these runs add).
RUNS = [("ppo", "torchrun"), ("ppo", "ray"), ("grpo", "ray"), ("rloo", "torchrun"), ("remax", "ray"),
        ("reinforce_plus_plus", "torchrun")]
# Half the runs at the default bf16 (the demo's own run among them), half at fp32, over both rollout engines.
FP32_RUNS = {("ppo", "ray"), ("grpo", "ray"), ("reinforce_plus_plus", "torchrun")}
# |rollout - actor| log-prob on the sampled tokens, max and mean: fp32 kernels agree to rounding; in bf16 the
# two engines round differently (measured on these runs: up to ~0.02 max, ~0.005 mean).
AGREEMENT = {"fp32": (1e-3, 1e-4), "bf16": (0.1, 0.02)}


# GRPO on Ray, colocated: vLLM generation resharded in place on the actor's two processes (TP2), in fp32, with
# Safe-RLHF's cost scored beside the reward. test_a_rollout_on_its_own_pool_trains_exactly_as_a_colocated_one
# runs the same job with its rollout on a pool of its own.
GRPO_RAY = ["trainer.nproc=2", "actor.engine.tensor_parallel=2", "actor.engine.micro_batch_size=4",
            "data.batch_size=8", "ppo.ppo_mini_batch_size=16", "trainer.total_steps=2", "trainer.val_every=2",
            "algorithm.safe_rlhf_cost_fn=format_check", "algorithm.safe_rlhf_cost_limit=-1.0",
            "algorithm.safe_rlhf_lambda_lr=0.5"]


def cli_job(algorithm: str, launcher: str) -> tuple[list[str], str]:
    """The `hybridflow train` arguments of one (algorithm, launcher) run (bar run_dir and model_path), and its precision."""
    # vLLM generates under torchrun and for GRPO on Ray, megatron's engine for the other Ray runs.
    engine = "vllm" if launcher == "torchrun" or algorithm == "grpo" else "megatron"
    # PPO under torchrun runs the demo's own layout: actor and critic at TP2 x PP2 on 4 processes.
    layout = ["trainer.nproc=4", "actor.engine.tensor_parallel=2", "actor.engine.pipeline_parallel=2",
              "critic.engine.tensor_parallel=2", "critic.engine.pipeline_parallel=2", "data.batch_size=8",
              "ppo.ppo_mini_batch_size=8", "critic_ppo.ppo_mini_batch_size=8"] if (algorithm, launcher) == ("ppo", "torchrun") else []
    if (algorithm, launcher) == ("ppo", "torchrun"):  # and truncated IS over whole sequences, on the recompute path
        layout += ["trainer.plots=true", "algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.level=sequence"]
    if (algorithm, launcher) == ("ppo", "ray"):
        layout = ["trainer.placement={critic: 1}"]  # split placement: the critic on its own pool of processes
    if (algorithm, launcher) == ("grpo", "ray"):  # Safe-RLHF: a cost scored beside the reward, a Lagrange multiplier
        layout = GRPO_RAY
    precision = "fp32" if (algorithm, launcher) in FP32_RUNS else "bf16"
    if precision == "fp32":
        layout = [*layout, "actor.engine.precision=fp32", "critic.engine.precision=fp32"]
    return ["--config", "examples/ppo_tiny.yaml", f"trainer.launcher={launcher}", f"algorithm.name={algorithm}",
            f"rollout.engine={engine}", *TINY, *ALGORITHMS[algorithm], *layout], precision


def train_run(run_dir: Path, model: str, job: list[str]) -> subprocess.CompletedProcess:
    proc = hybridflow("train", *job, f"trainer.run_dir={run_dir}", f"model_path={model}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def grpo_ray_colocated(tmp_path_factory, model) -> tuple[Path, subprocess.CompletedProcess]:
    """The GRPO-on-Ray run, once for the module: its own test checks it, the rollout-pool test compares against it."""
    run_dir = tmp_path_factory.mktemp("grpo-ray")
    return run_dir, train_run(run_dir, model, cli_job("grpo", "ray")[0])


@pytest.fixture(scope="module")
def ppo_ray_split(tmp_path_factory, model) -> tuple[Path, subprocess.CompletedProcess]:
    """The PPO-on-Ray run (the critic on a pool of its own, its phases beside the actor's), once for the module:
    its own test checks it, the overlap test compares the same job run in turn against it."""
    run_dir = tmp_path_factory.mktemp("ppo-ray")
    return run_dir, train_run(run_dir, model, cli_job("ppo", "ray")[0])


@pytest.mark.parametrize("algorithm,launcher", RUNS, ids=[f"{a}-{launcher}" for a, launcher in RUNS])
def test_every_algorithm_trains_through_the_cli(tmp_path, model, algorithm, launcher, request):
    job, precision = cli_job(algorithm, launcher)
    if (algorithm, launcher) == ("grpo", "ray"):
        tmp_path, proc = request.getfixturevalue("grpo_ray_colocated")
    elif (algorithm, launcher) == ("ppo", "ray"):
        tmp_path, proc = request.getfixturevalue("ppo_ray_split")
    else:
        proc = train_run(tmp_path, model, job)
    # A quiet console by default (the PPO torchrun run is the demo's own CLI and layout): nothing from vLLM,
    # megatron, Ray or transformers at WARNING / INFO on stdout.
    assert third_party_lines(proc.stdout) == [], proc.stdout[-3000:]
    steps = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == ([1, 2] if (algorithm, launcher) == ("grpo", "ray") else [1])
    for key in ("critic/score/mean", "critic/advantages/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean",
                "timing_s/gen", "timing_s/reshard", "timing_s/update_actor", "timing_s/step", "perf/throughput",
                "rollout/logprob_diff_max"):
        assert key in steps[0], (key, sorted(steps[0]))
    assert "val/reward/mean" in steps[-1]
    assert ("critic/vf_loss" in steps[0]) == (algorithm == "ppo")  # only PPO has a critic
    # The others take 4 epochs (examples/ppo_tiny.yaml): a separate old-log-prob pass.
    assert ("timing_s/old_log_prob" in steps[0]) == (algorithm not in ("grpo", "rloo"))
    most, mean = AGREEMENT[precision]  # rollout and actor agree on the sampled tokens
    assert steps[0]["rollout/logprob_diff_max"] < most and steps[0]["rollout/logprob_diff_mean"] < mean, steps[0]
    if (algorithm, launcher) == ("ppo", "torchrun"):  # sequence-level TIS: each weight in (0, cap 2], none masked
        assert 0.0 < steps[0]["rollout_corr/weight_mean"] <= 2.0 and 0.0 <= steps[0]["rollout_corr/truncated_frac"] <= 1.0
        assert steps[0]["rollout_corr/masked_frac"] == 0.0
        assert abs(steps[0]["rollout_corr/kl_k1"]) < 0.05 and 0.9 < steps[0]["rollout_corr/ppl_ratio"] < 1.1
    if algorithm in ("grpo", "rloo"):  # group baselines: advantages average out within each prompt's samples
        assert abs(steps[0]["critic/advantages/mean"]) < 1e-5
    if (algorithm, launcher) == ("grpo", "ray"):
        # The cost (0 or 1) always exceeds the limit -1, so lambda grows by lr * (cost - limit) each step.
        first, second = steps[0], steps[1]
        assert first["safe_rlhf/lambda"] == 1.0
        assert second["safe_rlhf/lambda"] == pytest.approx(1.0 + 0.5 * (first["safe_rlhf/cost/mean"] + 1.0))
    assert "[hybridflow]   metrics:" in proc.stdout
    assert (tmp_path / "plots" / "reward.png").is_file() == ((algorithm, launcher) == ("ppo", "torchrun"))
    if (algorithm, launcher) == ("ppo", "torchrun"):  # the demo's layout: every rank ends with its work
        assert proc.ending_s < 30, f"the job ended {proc.ending_s:.1f} s after its last line"
    assert (tmp_path / "checkpoints" / "trainer" / "latest").is_file()  # saved at the end


# The rollout-pool run agrees with the colocated one on these, step by step (the transfer is bit-exact, the seeds
# the same, both at two generation replicas of TP1).
SAME = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
        "rollout/logprob_diff_max", "safe_rlhf/cost/mean", "val/reward/mean", "val/response_length/mean")


def test_a_rollout_on_its_own_pool_trains_exactly_as_a_colocated_one(tmp_path, model, grpo_ray_colocated):
    """GRPO on Ray with ``trainer.placement.rollout``: generation on two processes of its own, the weights sent
    across pools by the actor after every update, against the same job colocated."""
    job = cli_job("grpo", "ray")[0]
    proc = train_run(tmp_path, model, [*job, "trainer.placement={rollout: 2}"])
    separate, colocated = read_metrics(tmp_path), read_metrics(grpo_ray_colocated[0])
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
                       proc.stderr)
    assert stated, proc.stderr[-3000:]
    p2p, broadcast, chosen = int(stated[1]), int(stated[2]), stated[3]
    assert chosen == ("p2p" if p2p <= broadcast else "broadcast")


def test_a_split_placement_runs_its_pools_at_the_same_time_and_trains_exactly_as_in_turn(tmp_path, model,
                                                                                          ppo_ray_split):
    """PPO on Ray with the critic on a pool of its own (fp32): with ``trainer.overlap`` (the default) the values
    ran beside the old log-probs and the critic's update beside the actor's, by the phases' own timestamps;
    ``trainer.overlap=false`` runs them in turn. Every metric but the timings is the same."""
    train_run(tmp_path, model, [*cli_job("ppo", "ray")[0], "trainer.overlap=false"])
    overlapped, in_turn = read_metrics(ppo_ray_split[0]), read_metrics(tmp_path)

    def span(step, pool, phase):
        return step[f"timing_s/phase/{pool}/{phase}/start"], step[f"timing_s/phase/{pool}/{phase}/end"]

    def together(a, b):
        return a[0] < b[1] and b[0] < a[1]

    for step in overlapped:
        assert together(span(step, "critic", "update_critic"), span(step, "default", "update_actor"))
        assert together(span(step, "critic", "values"), span(step, "default", "old_log_prob"))
        assert span(step, "default", "rollout")[1] <= span(step, "default", "old_log_prob")[0]  # a pool: in turn
        assert step["timing_s/update"] < step["timing_s/update_critic"] + step["timing_s/update_actor"]
    for step in in_turn:
        assert span(step, "critic", "update_critic")[1] <= span(step, "default", "update_actor")[0]
        assert span(step, "default", "old_log_prob")[1] <= span(step, "critic", "values")[0]
        assert step["timing_s/update"] >= step["timing_s/update_critic"] + step["timing_s/update_actor"]
    for step in overlapped + in_turn:  # each pool's idle time: the step less the union of its phases
        assert 0 <= step["timing_s/idle/critic"] < step["timing_s/step"] and "timing_s/idle/default" in step
    assert [s["step"] for s in overlapped] == [s["step"] for s in in_turn]
    for a, b in zip(overlapped, in_turn):
        assert exact(a) == pytest.approx(exact(b), rel=1e-6, abs=1e-7)
    for role in ("actor", "critic"):  # and the weights and Adam's moments the step left, bit for bit
        ours, theirs = checkpoint(ppo_ray_split[0], 1, role), checkpoint(tmp_path, 1, role)
        assert ours.keys() == theirs.keys() and any(k.startswith("optimizer.state.exp_avg") for k in ours)
        assert all(torch.equal(ours[k], theirs[k]) if isinstance(ours[k], torch.Tensor) else ours[k] == theirs[k]
                   for k in ours), role


def checkpoint(run_dir, step: int, role: str = "actor") -> dict:
    """``role``'s checkpoint at ``step`` read back whole (every rank's shards: weights and Adam's moments),
    and its LR schedule."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = run_dir / "checkpoints" / role / f"step_{step:08d}"
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


def exact(step: dict) -> dict:
    """A step's metrics but wall-clock times, throughput and memory."""
    return {k: v for k, v in step.items() if not k.startswith(("timing_s/", "perf/", "rollout/tokens_per_s"))}


DEMO = [*TINY[:7], "data.train_size=64", "data.val_size=8", "rollout.sampling.max_new_tokens=4",
        "rollout.max_prompt_length=8", "trainer.logger=[jsonl]", "trainer.val_every=0",
        "trainer.export_hf=false", "trainer.plots=false", "data.batch_size=16", "ppo.ppo_mini_batch_size=16",
        "critic_ppo.ppo_mini_batch_size=16"]


def test_demo_task_stopped_and_resumed_reproduces_the_run_and_exports_its_weights(tmp_path, model):
    # (Whether bf16 learns as fp32 does, over 8 steps and several seeds, is tools/precision_learning.py's
    # measurement; its figures are on the benchmarks page.)
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    proc = hybridflow("train", "--config", "examples/ppo_tiny.yaml", f"trainer.run_dir={full}", f"model_path={model}", *DEMO,
                      "trainer.total_steps=3", "trainer.save_every=2")
    assert proc.returncode == 0, proc.stderr[-5000:]
    steps = read_metrics(full)  # bf16, the default
    assert [s["step"] for s in steps] == [1, 2, 3]

    # Stop at step 2: a run directory whose newest complete checkpoint is step 2 (the trainer state is the
    # commit point, so pointing it back is exactly what a run stopped after step 2 leaves), then resume to 3
    # in new processes.
    shutil.copytree(full, stopped)
    (stopped / "checkpoints" / "trainer" / "latest").write_text("step_00000002.json")
    proc = hybridflow("train", "--config", "examples/ppo_tiny.yaml", f"trainer.run_dir={stopped}", f"model_path={model}",
                      *DEMO, "trainer.total_steps=3", "trainer.save_every=2", "trainer.resume=true",
                      "trainer.export_hf=true")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "resumed at step 2" in proc.stderr
    resumed = read_metrics(stopped)
    assert [s["step"] for s in resumed] == [1, 2, 3]

    for a, b in zip(steps, resumed):
        assert exact(a) == exact(b), a["step"]

    # `hybridflow export` turns the newest checkpoint into the same HF weights the run exported at its end.
    proc = hybridflow("export", str(stopped), "--out", str(tmp_path / "exported"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    def weights(path):
        return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}

    ours, final = weights(tmp_path / "exported"), weights(stopped / "hf_actor")
    assert ours.keys() == final.keys() and all(ours[k].equal(final[k]) for k in ours)
    assert AutoTokenizer.from_pretrained(tmp_path / "exported").decode([20, 21]) == "12"
