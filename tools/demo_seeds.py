"""`make demo`'s pipeline (SFT warm start, then PPO rewarded for exact answers) for several seeds.

    python tools/demo_seeds.py                                  # seeds 0 1 2: the README's figures
    python tools/demo_seeds.py --seeds 3 --json seed3.json --plot seed3.png
    python tools/demo_seeds.py --sft-config examples/moe_arithmetic_sft.yaml \
        --rl-config examples/moe_arithmetic.yaml --min-gain 0.1   # the mixture of experts' pipeline
    python tools/demo_seeds.py --check                          # seed 0 against docs/demo/seeds.json

``--check [FILE]`` runs the documented seeds (``--seeds`` to choose some) and compares each one's figures with
FILE's (default docs/demo/seeds.json, whose seed 0 is what `make demo` prints): the greedy accuracy after SFT
and after RL must be equal (each a count out of 64). Whatever the verdict, it says where the two runs first part:
the first SFT loss that differs (beyond 1e-6, relative) and the first RL step whose sampled reward differs. A
run that parts at SFT step 1 computed differently from its first forward (another CPU's kernels, another
library); one that parts later points at what that step does.

Each seed runs the two commands of `make demo` in new processes, with ``trainer.seed`` set in both
(the SFT data order; the RL data order and the rollout's sampling streams):

    hybridflow sft   --config examples/sft_tiny.yaml    trainer.seed=S trainer.run_dir=OUT/seed_S/sft
    hybridflow train --config examples/ppo_from_sft.yaml trainer.seed=S trainer.run_dir=OUT/seed_S/rl \\
                     model_path=OUT/seed_S/sft/hf_actor

The task (problems, held-out prompts) and the built-in model's initial weights are the same for every
seed. Printed per seed: the SFT validation loss at its last step, the greedy exact-answer accuracy on
the 64 held-out prompts after SFT (the RL job's validation before its first step) and after RL, the
gain, and each job's wall-clock seconds; then whether every seed gained at least ``--min-gain``.
``--json`` writes the curves (SFT loss and validation loss, RL accuracy and sampled reward) and
``--plot`` draws them, one line per seed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HYBRIDFLOW = [sys.executable, "-m", "controller.cli"]

from controller.metrics.log import read_metrics  # noqa: E402  (the runs' metrics.jsonl)


def _curve(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]


def run_logged(command: list[str], log: Path) -> float:
    """Run ``command`` from the project root with its output in ``log``; its wall-clock seconds (exits on failure)."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command[2:])} failed (exit {proc.returncode}); its output: {log}")
    return time.perf_counter() - start


def run_seed(seed: int, out: Path, overrides: list[str], sft_config: str = "examples/sft_tiny.yaml",
             rl_config: str = "examples/ppo_from_sft.yaml") -> dict[str, Any]:
    sft_dir, rl_dir = out / f"seed_{seed}" / "sft", out / f"seed_{seed}" / "rl"
    sft_dir.parent.mkdir(parents=True, exist_ok=True)
    common = [f"trainer.seed={seed}", "trainer.plots=false"]
    sft_s = run_logged([*HYBRIDFLOW, "sft", "--config", sft_config, *common, f"trainer.run_dir={sft_dir}"],
                 sft_dir.parent / "sft.log")
    rl_s = run_logged([*HYBRIDFLOW, "train", "--config", rl_config, *common, f"trainer.run_dir={rl_dir}",
                 f"model_path={sft_dir / 'hf_actor'}", *overrides], sft_dir.parent / "rl.log")
    sft, rl = read_metrics(sft_dir), read_metrics(rl_dir)
    accuracy = _curve(rl, "val/reward/mean")
    if not accuracy or accuracy[0][0] != 0:
        raise SystemExit(f"{rl_dir}: no validation before the first step (trainer.val_before_train)")
    return {"seed": seed, "sft_seconds": round(sft_s, 1), "rl_seconds": round(rl_s, 1),
            "sft_loss": _curve(sft, "sft/loss"), "sft_val_loss": _curve(sft, "sft/val_loss"),
            "accuracy": accuracy, "sampled_reward": _curve(rl, "critic/score/mean"),
            "accuracy_after_sft": accuracy[0][1], "accuracy_after_rl": accuracy[-1][1],
            "gain": accuracy[-1][1] - accuracy[0][1]}


def format_table(runs: list[dict[str, Any]]) -> str:
    lines = ["seed | SFT val loss | accuracy after SFT | after RL | gain   | SFT s | RL s",
             "---- | ------------ | ------------------ | -------- | ------ | ----- | ----"]
    for r in runs:
        lines.append(f"{r['seed']:>4} | {r['sft_val_loss'][-1][1]:>12.3f} | {r['accuracy_after_sft']:>18.3f} | "
                     f"{r['accuracy_after_rl']:>8.3f} | {r['gain']:+.3f} | {r['sft_seconds']:>5.0f} | {r['rl_seconds']:>4.0f}")
    return "\n".join(lines)


def first_difference(ours: list, theirs: list, rel: float = 0.0) -> int | None:
    """The first step whose value differs between two curves of (step, value) (beyond ``rel``, relative); None
    when they agree as far as both go."""
    for (step, a), (_, b) in zip(ours, theirs):
        if abs(a - b) > rel * max(abs(a), abs(b)):
            return step
    return None


def compare(documented: dict[str, Any], measured: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(mismatches, notes) of one seed's measured run against its documented one: a mismatch is a figure the
    docs state that the run did not give; the notes say where the two runs first part."""
    seed, mismatches = measured["seed"], []
    for key, what in (("accuracy_after_sft", "greedy accuracy after SFT"), ("accuracy_after_rl", "after RL")):
        if measured[key] != documented[key]:
            mismatches.append(f"seed {seed}: {what} {measured[key]:.3f}, documented {documented[key]:.3f}")
    notes = []
    sft = first_difference(measured["sft_loss"], documented["sft_loss"], rel=1e-6)
    rl = first_difference(measured["sampled_reward"], documented["sampled_reward"])
    if sft is not None:
        notes.append(f"seed {seed}: the SFT loss first differs at step {sft}" +
                     (" (the first forward: another CPU's kernels or another library computed it)" if sft == 1 else ""))
    if rl is not None:
        notes.append(f"seed {seed}: the RL sampled reward first differs at step {rl}")
    if sft is None and rl is None:
        notes.append(f"seed {seed}: the SFT losses and the RL sampled rewards equal the documented run's, step for step")
    return mismatches, notes


def check(path: Path, runs: list[dict[str, Any]]) -> int:
    """Print how ``runs`` compare with ``path``'s documented runs; 0 when every documented figure was given."""
    documented = {r["seed"]: r for r in json.loads(path.read_text())["runs"]}
    mismatches: list[str] = []
    for run in runs:
        found, notes = compare(documented[run["seed"]], run)
        mismatches += found
        for line in found + notes:
            print(line)
    print(f"{path}: {'the documented figures hold' if not mismatches else 'the documented figures do not hold'}")
    return 0 if not mismatches else 1


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in runs:
        line, = left.plot(*zip(*r["sft_loss"]), alpha=0.35, lw=1)
        left.plot(*zip(*r["sft_val_loss"]), color=line.get_color(), marker="o", ms=3, label=f"seed {r['seed']} (val)")
        right.plot(*zip(*r["accuracy"]), color=line.get_color(), marker="o", ms=3, label=f"seed {r['seed']}")
    left.set(title="SFT: token-mean loss (faint: train)", xlabel="SFT step", ylabel="cross-entropy")
    right.set(title="RL: greedy exact-answer accuracy, 64 held-out", xlabel="RL step (0: the SFT model)",
              ylabel="accuracy", ylim=(0, 1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "demo_seeds", help="run directories go here")
    parser.add_argument("--min-gain", type=float, default=0.2, help="the accuracy gain every seed must reach")
    parser.add_argument("--sft-config", default="examples/sft_tiny.yaml", help="the SFT job's config")
    parser.add_argument("--rl-config", default="examples/ppo_from_sft.yaml", help="the RL job's config (from the SFT export)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--check", type=Path, nargs="?", const=ROOT / "docs" / "demo" / "seeds.json",
                        help="compare with the documented runs (default docs/demo/seeds.json); seed 0 unless --seeds")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the RL job")
    args = parser.parse_args(argv)
    if args.check is not None:
        if not args.check.is_file():
            parser.error(f"--check {args.check}: no such file")
        known = {r["seed"] for r in json.loads(args.check.read_text())["runs"]}
        seeds = args.seeds if "--seeds" in (argv if argv is not None else sys.argv) else [0]
        if not set(seeds) <= known:
            parser.error(f"--check {args.check} documents seeds {sorted(known)}, not {sorted(set(seeds) - known)}")
        args.seeds = seeds
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(seed, args.out, args.overrides, args.sft_config, args.rl_config))
        print(f"seed {seed}: accuracy {runs[-1]['accuracy_after_sft']:.3f} after SFT -> "
              f"{runs[-1]['accuracy_after_rl']:.3f} after RL", flush=True)
    print(format_table(runs))
    if args.check is not None:
        return check(args.check, runs)
    passed = all(r["gain"] >= args.min_gain for r in runs)
    print(f"every seed gained >= {args.min_gain}: {'yes' if passed else 'no'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"min_gain": args.min_gain, "sft_config": args.sft_config,
                                         "rl_config": args.rl_config, "overrides": args.overrides, "runs": runs}, indent=1))
    if args.plot:
        plot(runs, args.plot)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
