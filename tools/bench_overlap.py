"""PPO with the actor and the critic on separate one-process Ray pools, their phases at the same time
(``trainer.overlap=true``, the default) against in turn (``trainer.overlap=false``).

    OMP_NUM_THREADS=1 python tools/bench_overlap.py                       # 3 steps each
    python tools/bench_overlap.py --steps 3 --json build/bench_overlap.json --timeline docs/concepts/timeline.png

Both runs are the same ``hybridflow train`` job (fp32, 8 PPO epochs for each role, the seed fixed); each one
is repeated ``--repeats`` times, alternating, and the best of each is kept (the machine is shared). It reports:

  - ``update_s``: ``timing_s/update``, the wall time of the whole update phase (both updates), steps 2 to N
    (the first pays for start-up), and its ratio overlapped / in turn;
  - ``update_critic_s`` / ``update_actor_s``: each update's own time (with overlap they run side by side);
  - ``step_s`` and each pool's idle seconds;
  - ``max_metric_diff``: the largest difference between the two runs' step metrics (not the timings): the
    concurrency changes wall time only.

``--timeline`` writes the overlapped run's ``hybridflow plot --step 2`` timeline there. The target:
``update_s`` ratio at most 0.75, the metrics equal to 1e-6.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

JOB = ["--config", "examples/ppo_tiny.yaml", "trainer.launcher=ray", "trainer.nproc=1", "trainer.placement.critic=1",
       "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1", "critic.engine.tensor_parallel=1",
       "critic.engine.pipeline_parallel=1", "actor.engine.precision=fp32", "critic.engine.precision=fp32",
       "ppo.ppo_epochs=8", "critic_ppo.ppo_epochs=8"]
QUIET = ["trainer.val_every=0", "trainer.save_every=0", "trainer.logger=[jsonl]", "trainer.export_hf=false",
         "trainer.plots=false"]
TIMED = ("timing_s/", "perf/", "rollout/tokens_per_s")


def run(overlap: bool, steps: int, run_dir: Path) -> list[dict]:
    from controller.metrics.log import read_metrics

    command = [sys.executable, "-m", "controller.cli", "train", *JOB, *QUIET, f"trainer.overlap={str(overlap).lower()}",
               f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"hybridflow train (overlap={overlap}) failed:\n{proc.stderr[-4000:]}")
    return read_metrics(run_dir)


def summary(steps: list[dict]) -> dict:
    later = steps[1:]

    def mean(key: str) -> float:
        return statistics.mean(s[key] for s in later)

    pools = sorted(k.removeprefix("timing_s/idle/") for k in later[0] if k.startswith("timing_s/idle/"))
    return {"update_s": mean("timing_s/update"), "update_critic_s": mean("timing_s/update_critic"),
            "update_actor_s": mean("timing_s/update_actor"), "step_s": mean("timing_s/step"),
            "idle_s": {pool: mean(f"timing_s/idle/{pool}") for pool in pools}}


def max_metric_diff(a: list[dict], b: list[dict]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith(TIMED)}
        if keys != {k for k in y if not k.startswith(TIMED)}:
            raise SystemExit(f"the runs logged different metrics: {sorted(keys ^ {k for k in y if not k.startswith(TIMED)})}")
        for key in keys:
            if isinstance(x[key], (int, float)) and x[key] is not None and y[key] is not None:
                worst = max(worst, abs(x[key] - y[key]) / max(1.0, abs(y[key])))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each form, alternating; the best is kept")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--timeline", help="write the overlapped run's step-2 timeline PNG here")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (the first step pays for start-up)")
    sys.path.insert(0, str(ROOT))
    best: dict[bool, tuple[dict, list[dict], Path]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as scratch:
        for repeat in range(args.repeats):
            for overlap in (True, False):
                run_dir = Path(scratch) / f"{'overlap' if overlap else 'in_turn'}-{repeat}"
                steps = run(overlap, args.steps, run_dir)
                figures = summary(steps)
                print(f"overlap={overlap!s:5} run {repeat + 1}: update {figures['update_s']:.3f} s "
                      f"(critic {figures['update_critic_s']:.3f}, actor {figures['update_actor_s']:.3f}), "
                      f"step {figures['step_s']:.3f} s", flush=True)
                if overlap not in best or figures["update_s"] < best[overlap][0]["update_s"]:
                    best[overlap] = (figures, steps, run_dir)
        (together, together_steps, together_dir), (in_turn, in_turn_steps, _) = best[True], best[False]
        ratio = together["update_s"] / in_turn["update_s"]
        diff = max_metric_diff(together_steps, in_turn_steps)
        print(f"update phase, steps 2-{args.steps}: {together['update_s']:.3f} s overlapped, "
              f"{in_turn['update_s']:.3f} s in turn: {ratio:.2f}x (target <= 0.75)")
        print(f"step: {together['step_s']:.3f} s overlapped, {in_turn['step_s']:.3f} s in turn; idle overlapped "
              f"{together['idle_s']}, in turn {in_turn['idle_s']}")
        print(f"largest step-metric difference: {diff:.2e} (target <= 1e-6)")
        if args.timeline:
            from controller.metrics.plots import plot_run

            for path in plot_run(str(together_dir), str(Path(scratch) / "plots"), step=2):
                if path.name == "timeline.png":
                    Path(args.timeline).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, args.timeline)
                    print(f"timeline: {args.timeline}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "command": "hybridflow train " + " ".join(JOB) + " trainer.overlap=true|false",
            "steps": args.steps, "repeats": args.repeats, "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
            "overlapped": together, "in_turn": in_turn, "update_ratio": ratio, "max_metric_diff": diff}, indent=2) + "\n")
    if ratio > 0.75 or diff > 1e-6:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
