"""Rollout routing replay's figures: the mixture-of-experts example with and without replay.

    python tools/bench_router_replay.py                        # SFT once, then 10 RL steps per mode, vLLM in bf16
    python tools/bench_router_replay.py --sft-dir runs/moe_arithmetic_sft/hf_actor --steps 20 --json r3.json

The RL job is examples/moe_arithmetic.yaml (GRPO of the built-in Qwen3-MoE at EP2 on 4 processes) with
``rollout.engine`` (vLLM by default: its kernels differ from megatron's, as a GPU job's do), run twice from
the same SFT export and seed: ``algorithm.router_replay=measure`` (the rollout's routes travel with the
batch and are only compared) and ``rollout`` (the actor replays them). Both runs generate step 1's batch
from the same weights with the same seeds, so step 1 compares the two on the same tokens; later steps
drift apart. Printed per mode, step 1 and the mean over the run: the fraction of (token, layer) pairs whose
router's own top-k equals the rollout's (``router_replay/agreement``), the rollout-vs-trainer log-prob
mismatch (``rollout_corr/kl_k3``, and the largest per-token difference ``rollout/logprob_diff_max``), and
the greedy accuracy at the end. ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HYBRIDFLOW = [sys.executable, "-m", "controller.cli"]

from controller.metrics.log import read_metrics  # noqa: E402  (a run's metrics.jsonl)
from tools.demo_seeds import run_logged as run  # noqa: E402  (a command, its output in a log)

FIGURES = ("router_replay/agreement", "rollout_corr/kl_k3", "rollout/logprob_diff_max", "rollout/logprob_diff_mean")


def summary(records: list[dict]) -> dict:
    steps = [r for r in records if "actor/pg_loss" in r]
    out = {"step_1": {k: steps[0].get(k) for k in FIGURES},
           "mean": {k: sum(r[k] for r in steps) / len(steps) for k in FIGURES if all(k in r for r in steps)},
           "val_accuracy": [(r["step"], r["val/reward/mean"]) for r in records if "val/reward/mean" in r]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-dir", help="an SFT export to start from (default: run examples/moe_arithmetic_sft.yaml)")
    parser.add_argument("--out", default="runs/bench_router_replay")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--engine", default="vllm", choices=["vllm", "megatron"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    sft = Path(args.sft_dir) if args.sft_dir else out / "sft" / "hf_actor"
    if not args.sft_dir:
        seconds = run([*HYBRIDFLOW, "sft", "--config", "examples/moe_arithmetic_sft.yaml", f"trainer.seed={args.seed}",
                       "trainer.plots=false", f"trainer.run_dir={out / 'sft'}"], out / "sft.log")
        print(f"SFT: {seconds:.0f} s -> {sft}")
    results = {}
    for mode in ("measure", "rollout"):
        run_dir = out / mode
        seconds = run([*HYBRIDFLOW, "train", "--config", "examples/moe_arithmetic.yaml", f"model_path={sft}",
                       f"trainer.run_dir={run_dir}", f"trainer.total_steps={args.steps}", f"trainer.val_every={args.steps}",
                       "trainer.save_every=0", "trainer.plots=false", "trainer.export_hf=false",
                       f"trainer.seed={args.seed}", f"rollout.engine={args.engine}", f"algorithm.router_replay={mode}"],
                      out / f"{mode}.log")
        results[mode] = {**summary(read_metrics(run_dir)), "seconds": seconds}
    print(f"\n{args.steps} GRPO steps of examples/moe_arithmetic.yaml, rollout.engine={args.engine}, seed {args.seed}")
    print(f"{'mode':<9} {'':<7} {'agreement':>10} {'kl_k3':>10} {'diff max':>9} {'diff mean':>10}")
    for mode, result in results.items():
        for when in ("step_1", "mean"):
            f = result[when]
            print(f"{mode:<9} {when:<7} {f.get(FIGURES[0], float('nan')):>10.4f} {f.get(FIGURES[1], float('nan')):>10.2e} "
                  f"{f.get(FIGURES[2], float('nan')):>9.4f} {f.get(FIGURES[3], float('nan')):>10.2e}")
        print(f"{mode:<9} greedy accuracy {result['val_accuracy']}; {result['seconds']:.0f} s")
    ratio = results["measure"]["step_1"][FIGURES[1]] / max(results["rollout"]["step_1"][FIGURES[1]], 1e-30)
    print(f"step 1, the same batch: kl_k3 without replay / with replay = {ratio:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "engine": args.engine, "seed": args.seed,
                                               "modes": results, "kl_k3_ratio_step_1": ratio}, indent=1))


if __name__ == "__main__":
    main()
