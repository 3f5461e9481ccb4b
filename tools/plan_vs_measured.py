"""The planner's predicted step time against measured runs on this machine (`--cluster local`).

    python tools/plan_vs_measured.py                       # every run, a markdown table
    python tools/plan_vs_measured.py --runs tiny-colocated-tp2pp2 --steps 4 --json build/plan_vs_measured.json

Each run is a real `hybridflow train` job on 4 CPU processes: the tiny and the small (76M) built-in models,
colocated, split (actor | critic) and one-step-off (actor | rollout) placements, several TP / PP. It trains
`--steps` steps; the measured step time is the mean of `timing_s/step` after the first step (which compiles
and warms up). The prediction is the planner's score of the job's own plan (`controller.planner.prelaunch.job_plan`)
on this machine's calibration (`hybridflow plan --calibrate`, which it runs first unless `--no-calibrate`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.config import load_config  # noqa: E402
from controller.planner.calibrate import load_calibration, local_cluster, measure, save_calibration  # noqa: E402
from controller.planner.prelaunch import job_plan  # noqa: E402
from controller.planner.workload import job_workload  # noqa: E402

QUIET = ["trainer.val_every=0", "trainer.save_every=0", "trainer.logger=[jsonl]", "trainer.export_hf=false",
         "trainer.plots=false", "data.val_size=8", "data.train_size=512"]
PPO = ["--config", "examples/ppo_tiny.yaml"]
GRPO = [*PPO, "algorithm.name=grpo", "rollout.sampling.n=4", "data.batch_size=16", "ppo.ppo_mini_batch_size=32"]
SMALL = ["model_path=builtin:small-arithmetic", "data.batch_size=16", "ppo.ppo_mini_batch_size=16",
         "critic_ppo.ppo_mini_batch_size=16", "ppo.ppo_epochs=1", "critic_ppo.ppo_epochs=1"]


def layout(role: str, tp: int, pp: int, micro: int = 8) -> list[str]:
    return [f"{role}.engine.tensor_parallel={tp}", f"{role}.engine.pipeline_parallel={pp}",
            f"{role}.engine.micro_batch_size={micro}"]


RUNS = {
    "tiny-colocated-tp2pp2": [*PPO],
    "tiny-colocated-dp4": [*PPO, *layout("actor", 1, 1), *layout("critic", 1, 1)],
    "tiny-colocated-tp2dp2": [*PPO, *layout("actor", 2, 1), *layout("critic", 2, 1)],
    "tiny-colocated-pp2dp2": [*PPO, *layout("actor", 1, 2), *layout("critic", 1, 2)],
    "tiny-split-actor|critic": [*PPO, "trainer.launcher=ray", "trainer.nproc=2", "trainer.placement={critic: 2}",
                                *layout("actor", 1, 1), *layout("critic", 1, 1)],
    "tiny-one-step-off-actor|rollout": [*GRPO, "trainer.launcher=ray", "trainer.nproc=2", "trainer.placement={rollout: 2}",
                                        "trainer.mode=one_step_off", *layout("actor", 1, 1)],
    "small-colocated-tp2dp2": [*PPO, *SMALL, *layout("actor", 2, 1, 4), *layout("critic", 2, 1, 4)],
    "small-colocated-dp4": [*PPO, *SMALL, *layout("actor", 1, 1, 4), *layout("critic", 1, 1, 4)],
}


def processes(config) -> int:
    from controller.config import distinct_pools, job_pools

    return sum(shape.world_size for shape in distinct_pools(job_pools(config.trainer)))


def run(name: str, steps: int, work: Path) -> dict:
    args = RUNS[name]
    overrides = [a for a in args if "=" in a and not a.startswith("--")]
    config_path = args[args.index("--config") + 1]
    run_dir = work / name.replace("|", "_")
    command = [sys.executable, "-m", "controller.cli", "train", *args, *QUIET, f"trainer.total_steps={steps}",
               f"trainer.run_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, capture_output=True, text=True, cwd=str(ROOT), env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    measured = statistics.fmean(r["timing_s/step"] for r in later)
    phases = {k: statistics.fmean(r[k] for r in later) for k in later[0] if k.startswith("timing_s/")}
    config = load_config(ROOT / config_path, [*overrides, *QUIET, f"trainer.run_dir={run_dir}"])
    cluster = local_cluster(processes(config))
    plan = job_plan(config, cluster, job_workload(config, flash_attention=False))
    return {"run": name, "processes": cluster.devices, "measured_step_s": measured, "predicted_step_s": plan.step_time,
            "ratio": plan.step_time / measured, "predicted_stage_s": list(plan.stage_times),
            "measured_phases_s": phases}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-calibrate", action="store_true", help="use the saved calibration")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if not args.no_calibrate:
        save_calibration(measure())
    figures = load_calibration()
    print(f"calibration: {figures['fp32_flops'] / 1e9:.1f} GFLOP/s fp32, {figures['memory_bandwidth'] / 1e9:.1f} GB/s, "
          f"gloo {figures['gloo_latency_s'] * 1e6:.0f} us / {figures['gloo_bandwidth'] / 1e9:.2f} GB/s")
    results = []
    print("| run | processes | measured s/step | predicted s/step | predicted / measured |")
    print("| --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            result = run(name, args.steps, Path(tmp))
            results.append(result)
            print(f"| {name} | {result['processes']} | {result['measured_step_s']:.2f} | {result['predicted_step_s']:.2f} | "
                  f"{result['ratio']:.2f} |", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"calibration": figures, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
