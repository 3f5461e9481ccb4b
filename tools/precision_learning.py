"""Does bf16 learn as fp32 does? The tiny demo task (examples/ppo_tiny.yaml) at both precisions, several seeds.

    python tools/precision_learning.py                         # seeds 0 1, 8 steps: the docs' figures
    python tools/precision_learning.py --steps 16 --seeds 0 1 2 --json precision.json

Each (seed, precision) is one ``hybridflow train`` run in new processes: PPO on the built-in tiny model,
one process, 16 prompts a step, 4 new tokens, the reward ``arithmetic_shaped`` (examples/ppo_tiny.yaml);
``actor.engine.precision`` and ``critic.engine.precision`` are the only difference between the two runs
of a seed. Printed per run: the sampled reward's mean over the first and the last 3 steps and the gain
between them; per seed, the bf16 gain minus the fp32 gain. ``--max-gap`` is what the two may differ by
(exit status 1 beyond it, or when a run does not gain ``--min-gain``). ``--json`` writes every curve.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HYBRIDFLOW = [sys.executable, "-m", "controller.cli"]

from controller.metrics.log import read_metrics  # noqa: E402  (the runs' metrics.jsonl)

TASK = ["trainer.nproc=1", "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1",
        "critic.engine.tensor_parallel=1", "critic.engine.pipeline_parallel=1", "actor.engine.micro_batch_size=2",
        "critic.engine.micro_batch_size=2", "data.train_size=64", "data.val_size=8",
        "rollout.sampling.max_new_tokens=4", "rollout.max_prompt_length=8", "trainer.logger=[jsonl]",
        "trainer.val_every=0", "trainer.save_every=0", "trainer.export_hf=false", "trainer.plots=false",
        "data.batch_size=16", "ppo.ppo_mini_batch_size=16", "critic_ppo.ppo_mini_batch_size=16"]


def gain(rewards: list[float], window: int = 3) -> float:
    """The sampled reward's mean over the last ``window`` steps minus its mean over the first ``window``."""
    if len(rewards) < 2 * window:
        raise ValueError(f"{len(rewards)} steps: a gain over windows of {window} needs at least {2 * window}")
    return sum(rewards[-window:]) / window - sum(rewards[:window]) / window


def run(precision: str, seed: int, steps: int, out: Path, model: str) -> dict:
    command = [*HYBRIDFLOW, "train", "--config", "examples/ppo_tiny.yaml", f"trainer.run_dir={out}",
               f"model_path={model}", f"trainer.seed={seed}", f"trainer.total_steps={steps}", *TASK,
               f"actor.engine.precision={precision}", f"critic.engine.precision={precision}"]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the {precision} run of seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rewards = [float(r["critic/score/mean"]) for r in read_metrics(out) if "critic/score/mean" in r]
    return {"precision": precision, "seed": seed, "rewards": rewards, "gain": gain(rewards),
            "seconds": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--min-gain", type=float, default=0.1, help="the gain every run must reach")
    parser.add_argument("--max-gap", type=float, default=0.15, help="how far a seed's bf16 and fp32 gains may differ")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from controller.models.builtin import resolve_model_path

    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model_path("builtin:tiny-arithmetic", Path(tmp) / "model")
        for seed in args.seeds:
            pair = {p: run(p, seed, args.steps, Path(tmp) / f"{p}_{seed}", model) for p in ("bf16", "fp32")}
            for row in pair.values():
                r = row["rewards"]
                print(f"seed {seed} {row['precision']}: reward {sum(r[:3]) / 3:.3f} -> {sum(r[-3:]) / 3:.3f} "
                      f"(gain {row['gain']:+.3f}) in {row['seconds']:.0f} s")
                ok &= row["gain"] >= args.min_gain
            gap = pair["bf16"]["gain"] - pair["fp32"]["gain"]
            print(f"seed {seed}: bf16 gain - fp32 gain = {gap:+.3f}")
            ok &= abs(gap) <= args.max_gap
            rows += pair.values()
    print(f"every run gained >= {args.min_gain} and every seed's gap is within {args.max_gap}: {'yes' if ok else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "runs": rows}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
