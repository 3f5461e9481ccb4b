"""Learning curves of the algorithm set, and the same runs in TRL where TRL has the algorithm.

    python tools/algorithm_curves.py                                   # every algorithm, 30 steps, seeds 0 and 1
    python tools/algorithm_curves.py --algorithms grpo,gspo --steps 10 --seeds 0 --json curves.json
    python tools/algorithm_curves.py --frameworks hybridflow           # no TRL

The task is tools/bench_e2e.py's, on its tiny model (a random Llama with a character tokenizer and a chat
template): chat-rendered single-digit arithmetic, the same rows in the same order on both sides, 8
prompts x 4 samples a step, 4 new tokens, one optimizer step per step. A random tiny model cannot find
exact sums in 30 steps (issue #19), so the reward is ``arithmetic_shaped``: 1 for the right number, else
up to 0.5 for answering with a number of the right length. The learning rate is the demo's, 5e-3.

Each algorithm runs with hybridflow's ``algorithm.name`` and, where TRL implements it, with TRL's
GRPOTrainer set to the same objective (``ALGORITHMS``: TRL's loss_type and importance_sampling_level,
the same clip ranges, the same advantage scaling). DAPO runs without dynamic sampling and overlong
shaping, which TRL does not have. Every (algorithm, framework) runs once per seed; the seeds change
the data order's sampling streams on both sides, so the spread between seeds is the run-to-run noise
against which the two frameworks' curves are compared.

Printed: the sampled reward over the first and last 5 steps of every run, the gain (last 5 - first 5),
the mean gain over seeds, the seeds' spread, and per algorithm the difference between the frameworks'
mean gains next to that spread. ``--json`` writes every curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools import bench_e2e as e2e  # noqa: E402  (the task, the two jobs and their runners)

# algorithm -> (GRPOSettings changes, whether TRL implements it). TRL's side of each pairing is
# tools/bench_e2e_trl.py's TRL_LOSSES.
ALGORITHMS: dict[str, tuple[dict[str, Any], bool]] = {
    "grpo": ({}, True),
    "dapo": ({"clip_ratio_high": 0.28}, True),
    "dr_grpo": ({"norm_adv_by_std": False, "loss_agg_mode": "seq-mean-token-sum-norm"}, True),
    "gspo": ({"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}, True),
    "cispo": ({"clip_ratio_low": 1.0, "clip_ratio_high": 4.0}, True),
    "gspo_token": ({"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}, False),
    "reinforce_plus_plus_baseline": ({}, False),
    "rloo": ({}, False),
    "remax": ({}, False),
    "reinforce_plus_plus": ({}, False),
}
TASK = dict(max_new_tokens=4, lr=5e-3, reward_fn="arithmetic_shaped")


def settings_for(algorithm: str, steps: int, seed: int) -> e2e.GRPOSettings:
    changes, _ = ALGORITHMS[algorithm]
    return e2e.GRPOSettings(steps=steps, seed=seed, algorithm=algorithm, **TASK, **changes)


def gain(rewards: list[float]) -> float:
    """Mean sampled reward over the last 5 steps minus the first 5."""
    return statistics.fmean(rewards[-5:]) - statistics.fmean(rewards[:5])


def summarize_curves(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (algorithm, framework): the gains of its seeds, their mean and spread (max - min), and the
    mean reward over each whole curve (how early the reward rose) with its mean over seeds."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        if run["status"] != "ok":
            continue
        key = (run["algorithm"], run["framework"])
        entry = out.setdefault(key, {"algorithm": key[0], "framework": key[1], "gains": [], "curve_means": []})
        entry["gains"].append(gain(run["rewards"]))
        entry["curve_means"].append(statistics.fmean(run["rewards"]))
    for entry in out.values():
        entry["mean_gain"] = statistics.fmean(entry["gains"])
        entry["spread"] = max(entry["gains"]) - min(entry["gains"])
        entry["mean_curve"] = statistics.fmean(entry["curve_means"])
        entry["curve_spread"] = max(entry["curve_means"]) - min(entry["curve_means"])
    return list(out.values())


def format_summary(summary: list[dict[str, Any]]) -> str:
    lines = [f"{'algorithm':30} {'framework':10} {'gains per seed':24} {'mean':>7} {'spread':>7}   "
             f"{'curve means':16} {'mean':>6}"]
    for e in summary:
        gains = " ".join(f"{g:+.3f}" for g in e["gains"])
        curves = " ".join(f"{c:.3f}" for c in e["curve_means"])
        lines.append(f"{e['algorithm']:30} {e['framework']:10} {gains:24} {e['mean_gain']:+7.3f} {e['spread']:7.3f}   "
                     f"{curves:16} {e['mean_curve']:6.3f}")
    by_alg: dict[str, dict[str, dict]] = {}
    for e in summary:
        by_alg.setdefault(e["algorithm"], {})[e["framework"]] = e
    for alg, sides in by_alg.items():
        if {"hybridflow", "trl"} <= set(sides):
            h, t = sides["hybridflow"], sides["trl"]
            noise, curve_noise = max(h["spread"], t["spread"]), max(h["curve_spread"], t["curve_spread"])
            lines.append(f"{alg}: hybridflow - TRL mean gain {h['mean_gain'] - t['mean_gain']:+.3f} "
                         f"(run-to-run spread up to {noise:.3f}); mean curve {h['mean_curve'] - t['mean_curve']:+.3f} "
                         f"(spread up to {curve_noise:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"of {', '.join(ALGORITHMS)}")
    parser.add_argument("--frameworks", default="hybridflow,trl")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", default=str(ROOT / "build" / "algorithm_curves"))
    parser.add_argument("--trl-venv", default=str(ROOT / "build" / "trl-venv"))
    parser.add_argument("--row-timeout", type=float, default=1800)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        algorithms = e2e.parse_list(args.algorithms, tuple(ALGORITHMS), "algorithms")
        frameworks = e2e.parse_list(args.frameworks, e2e.FRAMEWORKS, "frameworks")
        seeds = [int(t) for t in args.seeds.split(",") if t.strip()]
        if not seeds or min(seeds) < 0:
            raise ValueError(f"--seeds must be a list of integers >= 0, got {args.seeds!r}")
        if args.steps < 10:
            raise ValueError(f"--steps must be >= 10 (the gain compares the first and last 5), got {args.steps}")
    except ValueError as exc:
        parser.error(str(exc))
    work = Path(args.work_dir).resolve()
    for sub in ("models", "data", "runs"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    python = e2e.ensure_trl_venv(Path(args.trl_venv).resolve(), work / "trl-install.log") if "trl" in frameworks else None
    train_file = e2e.write_data(work / "data")
    model_dir = e2e.prepare_model("tiny", work / "models")
    ids = e2e.prompt_token_ids(model_dir, train_file)
    max_prompt = -(-max(len(i) for i in ids) // 8) * 8
    runs = []
    for algorithm in algorithms:
        for framework in frameworks:
            if framework == "trl" and not ALGORITHMS[algorithm][1]:
                continue
            for seed in seeds:
                s = settings_for(algorithm, args.steps, seed)
                run_id = f"{algorithm}-{framework}-seed{seed}"
                row_dir = work / "runs" / run_id
                shutil.rmtree(row_dir, ignore_errors=True)
                row_dir.mkdir(parents=True)
                print(f"[algorithm_curves] {run_id}: {s.steps} steps ...", file=sys.stderr, flush=True)
                run: dict[str, Any] = {"id": run_id, "algorithm": algorithm, "framework": framework, "seed": seed,
                                       "settings": dataclasses.asdict(s), "status": "ok", "error": None}
                start = time.perf_counter()
                try:
                    if framework == "hybridflow":
                        cfg = e2e.hybridflow_config(s, str(model_dir), str(train_file), str(row_dir / "run"), "fp32",
                                                    max_prompt, 256 << 20)
                        out = e2e.run_hybridflow(row_dir, cfg, s.sequences, args.threads, args.row_timeout, False)
                    else:
                        spec = e2e.trl_spec(s, str(model_dir), str(train_file), str(row_dir / "trl"), "fp32",
                                            "autocast", args.threads, ids[: s.steps * s.prompts_per_step])
                        out = e2e.run_trl(row_dir, spec, python, args.row_timeout)
                    run["rewards"] = [st["reward"] for st in out["per_step"]]
                    run["log"] = out["log"]
                except (e2e.RowFailed, ValueError, KeyError) as exc:
                    run.update(status="failed", error=str(exc))
                    print(f"[algorithm_curves] {run_id} FAILED: {exc}", file=sys.stderr)
                run["wall_s"] = time.perf_counter() - start
                if run["status"] == "ok":
                    r = run["rewards"]
                    print(f"[algorithm_curves] {run_id}: reward {statistics.fmean(r[:5]):.3f} -> "
                          f"{statistics.fmean(r[-5:]):.3f} ({run['wall_s']:.0f} s)", file=sys.stderr)
                runs.append(run)
    summary = summarize_curves(runs)
    print(format_summary(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary, "task": TASK}, indent=2))
    return 0 if all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
