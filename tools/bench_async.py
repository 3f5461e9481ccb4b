"""The same GRPO job five ways: colocated sync, disaggregated sync, one step off, async (whole responses
per rollout call) and async with partial rollouts (half a response per call).

    python tools/bench_async.py                      # 8 steps each, on Ray, CPU
    python tools/bench_async.py --steps 12 --json build/bench_async.json

Each mode runs ``hybridflow train`` on the built-in tiny model (the actor on one process; the
rollout on the actor's process, or on one process of its own) with the same data, seeds and
schedule, and reports per mode, the means over the steps after the first (which pays for start-up;
means, not medians, since an async schedule can alternate between steps that wait and steps that do not):

  - step_s:       step time;
  - gen_s / train_s: the rollout's generation time and the training side's busy time (the step
                   minus what it waited for the rollout and the weight transfer);
  - overlap:      the fraction of the step during which both pools are busy (one step off and async:
                   the generation that hid behind training, gen_s - wait_rollout_s, over step_s);
  - partial:      async only: samples a weight update interrupted mid-response, and trained samples
                   whose tokens span two policy versions, per step;
  - staleness:    the histogram of the trained samples' staleness;
  - transfer:     the cross-pool weight transfer's bytes into the busiest generation rank against
                   the bound M / (t_g p_g), and its time;
  - reward:       the reward curve (mean score per step).

On 2 CPU cores both pools share the same cores, so the wall-clock gain is bounded here. The
report adds what a simple model predicts with separate devices, at the phase times of the
disaggregated sync run (each phase running alone): sync step = gen + train, one-step-off step =
max(gen, train), async step = max(train, h gen) + (1 - h) gen with h the share of generation the
async run hid behind training (its chunks are sequential: one runs while the actor trains), the
transfer on top of each. It then sets the model against the runs measured here, and shows where the gap comes from: how much slower each phase runs while the
other runs beside it on the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

JOB = ["--config", "examples/ppo_tiny.yaml", "algorithm.name=grpo", "rollout.sampling.n=4",
       "rollout.sampling.max_new_tokens=6", "data.batch_size=64", "trainer.launcher=ray", "trainer.nproc=1",
       "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1", "actor.engine.micro_batch_size=16",
       "ppo.ppo_mini_batch_size=128", "ppo.ppo_epochs=1", "rollout.engine=vllm",
       "trainer.val_every=0", "trainer.save_every=0", "trainer.logger=[jsonl]", "trainer.export_hf=false",
       "trainer.plots=false", "data.train_size=1024", "data.val_size=8"]
MODES = {
    "colocated_sync": [],
    "disaggregated_sync": ["trainer.placement={rollout: 1}"],
    "one_step_off": ["trainer.placement={rollout: 1}", "trainer.mode=one_step_off"],
    # whole responses per rollout call (the default), groups started while they stay within 1 update of staleness
    "async": ["trainer.placement={rollout: 1}", "trainer.mode=async"],
    # partial rollouts: half a response per call, so updates land mid-response; staleness up to 2
    "async_partial": ["trainer.placement={rollout: 1}", "trainer.mode=async", "trainer.partial_rollout_tokens=3",
                      "trainer.max_staleness=2"],
}


def run(mode: str, steps: int, out: Path) -> list[dict]:
    run_dir = out / mode
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "controller.cli", "train", *JOB, f"trainer.run_dir={run_dir}",
               f"trainer.total_steps={steps}", *MODES[mode]]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(steps: list[dict]) -> dict:
    later = steps[1:] or steps

    def med(key):
        values = [s.get(key, 0.0) for s in later]
        return statistics.fmean(values) if values else 0.0

    step_s, gen_s = med("timing_s/step"), med("timing_s/gen")
    wait_s, transfer_s = med("timing_s/wait_rollout"), med("timing_s/weight_transfer")
    overlapped = any("timing_s/wait_rollout" in s for s in later)
    # What the training side waited for: the whole generate call under sync (the transfer inside it), the
    # part of the generation training did not hide under one step off (the transfer beside it).
    rollout_s = med("timing_s/rollout")
    waited = wait_s + transfer_s if overlapped else rollout_s
    staleness: dict[str, float] = {}
    for s in steps:
        for key, value in s.items():
            if key.startswith("staleness/hist/"):
                staleness[key.rsplit("/", 1)[1]] = staleness.get(key.rsplit("/", 1)[1], 0.0) + value
    return {
        "step_s": step_s, "gen_s": gen_s, "rollout_s": rollout_s if not overlapped else gen_s,
        "train_s": step_s - waited,
        "wait_rollout_s": wait_s, "overlap": max(gen_s - wait_s, 0.0) / step_s if overlapped else 0.0,
        "transfer_s": transfer_s, "transfer_bytes": med("weight_transfer/bytes"),
        "transfer_bound_bytes": med("weight_transfer/bound_bytes"), "staleness_hist": staleness,
        "reward": [s["critic/score/mean"] for s in steps],
        "hidden_gen_share": max(gen_s - wait_s, 0.0) / gen_s if overlapped and gen_s else 0.0,
        "interrupted_samples": med("stream/interrupted_samples"),
        "mixed_version_samples": med("stream/mixed_version_samples"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="build/bench_async")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    results = {mode: summarize(run(mode, args.steps, out)) for mode in MODES}

    print(f"{'mode':<20} {'step_s':>7} {'gen_s':>6} {'train_s':>7} {'wait_s':>6} {'overlap':>7} "
          f"{'xfer_s':>6} {'xfer MiB (bound)':>17}  staleness")
    for mode, r in results.items():
        xfer = (f"{r['transfer_bytes'] / 2**20:.2f} ({r['transfer_bound_bytes'] / 2**20:.2f})"
                if r["transfer_bytes"] else "-")
        print(f"{mode:<20} {r['step_s']:7.3f} {r['gen_s']:6.3f} {r['train_s']:7.3f} {r['wait_rollout_s']:6.3f} "
              f"{r['overlap']:7.2f} {r['transfer_s']:6.3f} {xfer:>17}  {r['staleness_hist'] or '-'}")
    base, sep, off = (results[m] for m in ("colocated_sync", "disaggregated_sync", "one_step_off"))
    # The model: with separate devices a one-step-off step takes max(gen, train) plus the transfer, a sync one
    # gen + train plus the transfer; at the phase times of the disaggregated sync run (each phase alone).
    gen, train, xfer = sep["rollout_s"] - sep["transfer_s"], sep["train_s"], sep["transfer_s"]
    model_sync, model_off = gen + train + xfer, max(gen, train) + xfer
    prediction = {
        "model_sync_step_s": model_sync, "model_one_step_off_step_s": model_off,
        "separate_devices_speedup": model_sync / model_off,
        "measured_one_step_off_vs_disaggregated_sync": sep["step_s"] / off["step_s"],
        "measured_one_step_off_vs_colocated_sync": base["step_s"] / off["step_s"],
        # On 2 shared cores the phases slow each other down while they overlap.
        "gen_slowdown_overlapped": off["gen_s"] / sep["gen_s"] if sep["gen_s"] else 0.0,
        "train_slowdown_overlapped": off["train_s"] / train if train else 0.0,
    }
    print(f"\nmodel at the disaggregated sync phase times (gen {gen:.3f} s, train {train:.3f} s, transfer "
          f"{xfer:.3f} s): one step off {model_off:.3f} s a step against {model_sync:.3f} s sync, "
          f"{prediction['separate_devices_speedup']:.2f}x, with separate devices")
    print(f"measured here (2 shared cores): one step off {off['step_s']:.3f} s a step, "
          f"{prediction['measured_one_step_off_vs_disaggregated_sync']:.2f}x vs disaggregated sync, "
          f"{prediction['measured_one_step_off_vs_colocated_sync']:.2f}x vs colocated sync; overlapped, generation "
          f"takes {prediction['gen_slowdown_overlapped']:.2f}x and training {prediction['train_slowdown_overlapped']:.2f}x "
          f"their time alone (the cores they share)")
    for mode in ("async", "async_partial"):
        stream = results[mode]
        hidden = stream["hidden_gen_share"]
        model_async = max(train, hidden * gen) + (1 - hidden) * gen + xfer
        prediction.update({f"model_{mode}_step_s": model_async,
                           f"separate_devices_{mode}_speedup": model_sync / model_async,
                           f"measured_{mode}_vs_disaggregated_sync": sep["step_s"] / stream["step_s"],
                           f"measured_{mode}_vs_colocated_sync": base["step_s"] / stream["step_s"]})
        print(f"{mode}: {hidden:.2f} of generation hidden behind training; model with separate devices "
              f"{model_async:.3f} s a step ({model_sync / model_async:.2f}x over sync); measured here "
              f"{stream['step_s']:.3f} s, {sep['step_s'] / stream['step_s']:.2f}x vs disaggregated sync; "
              f"per step {stream['interrupted_samples']:.1f} samples interrupted by the update, "
              f"{stream['mixed_version_samples']:.1f} trained samples spanning two versions")
    print("reward curves:", {mode: [round(x, 3) for x in r["reward"]] for mode, r in results.items()})
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"modes": results, "prediction": prediction, "steps": args.steps,
                                               "job": JOB}, indent=1))


if __name__ == "__main__":
    main()
