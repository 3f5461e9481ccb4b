"""Long sequences: context parallelism's activation memory, packed micro-batches' throughput, a long-response
GRPO step at CP1 and CP2.

    python tools/bench_long_context.py                          # all three parts
    python tools/bench_long_context.py --parts memory --seq 8192 --json out.json

- **memory**: one sequence of ``--seq`` tokens through the actor (the tiny Llama shape) on CP 1, 2 and 4
  processes, rows packed; what autograd keeps for its backward on each rank (``saved_activation_bytes``, the
  busiest rank), against the planner's prediction (``controller.planner.memory``).
- **throughput**: ``update_actor`` (forward, backward, Adam) and ``compute_log_prob`` on one process over rows
  of long-tailed lengths (log-normal, a few rows 10-30x the median), micro-batches of the same token budget,
  padded against packed: real tokens per second, and the padding each pays.
- **grpo**: ``hybridflow train`` GRPO on 2 processes with long responses (``ignore_eos``: every response its
  full length), the actor data-parallel (CP1) and each sequence over both processes (CP2): step and update
  times (medians over the steps after the first).

Figures go in docs/concepts/long-sequences.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_models import SHAPES, make_checkpoint  # noqa: E402
from tools.torchrun_job import run_torchrun_job  # noqa: E402

PRECISION = "bf16"


def one_sequence(vocab: int, length: int, response: int):
    from workers import DataProto

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (1, length), generator=g)
    mask = torch.ones_like(ids)
    return DataProto({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
                      "responses": ids[:, -response:], "response_mask": mask[:, -response:]})


def long_tailed_batch(vocab: int, rows: int, median: int, longest: int, response: int, seed: int = 0):
    """``rows`` rows [left-padded prompt | right-padded response] whose lengths are log-normal around ``median``
    (sigma 1), cut at ``longest``: most rows short, a few 10-30x longer."""
    from workers import DataProto

    g = torch.Generator().manual_seed(seed)
    lengths = (median * torch.exp(torch.randn(rows, generator=g))).round().clamp(response + 1, longest).long()
    prompt = longest - response
    ids = torch.zeros(rows, longest, dtype=torch.long)
    mask = torch.zeros(rows, longest, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        p = n - response  # this row's prompt tokens, right-aligned in the prompt half
        ids[i, prompt - p:] = torch.randint(1, vocab, (p + response,), generator=g)
        mask[i, prompt - p:] = 1
    return DataProto({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                      "responses": ids[:, prompt:], "response_mask": mask[:, prompt:],
                      "old_log_probs": torch.full((rows, response), -5.0),
                      "advantages": torch.randn(rows, response, generator=g)}), int(lengths.sum())


def inner_memory(args) -> None:
    """Under torchrun (CP = the processes): one sequence's saved activations on each rank."""
    import os

    from controller import ResourcePool, WorkerGroup
    from workers.actor import Actor

    nproc = int(os.environ["WORLD_SIZE"])
    actor = WorkerGroup(ResourcePool([nproc]), Actor, role="actor", kwargs=dict(
        model_path=args.model_dir, optim={"lr": 1e-6},
        engine={"precision": PRECISION, "context_parallel": nproc, "pack_sequences": True, "micro_batch_size": 1}))
    measured = actor.saved_activation_bytes(one_sequence(SHAPES["tiny"]["vocab_size"], args.seq, 64))
    Path(args.inner).write_text(json.dumps({"cp": nproc, "seq": args.seq, "bytes_per_rank": [m["bytes"] for m in measured]}))


def inner_throughput(args) -> None:
    """One process: padded against packed micro-batches of one token budget on a long-tailed batch."""
    from controller import ResourcePool, WorkerGroup
    from workers.actor import Actor

    batch, real = long_tailed_batch(SHAPES["tiny"]["vocab_size"], args.rows, args.median, args.longest, 32)
    pool = ResourcePool([1])
    row = {"rows": args.rows, "median": args.median, "longest": args.longest, "real_tokens": real,
           "budget": args.budget}
    for packed in (False, True):
        actor = WorkerGroup(pool, Actor, role=f"actor_{int(packed)}", kwargs=dict(
            model_path=args.model_dir, optim={"lr": 1e-6},
            engine={"precision": PRECISION, "max_tokens_per_micro_batch": args.budget, "pack_sequences": packed},
            ppo={"ppo_mini_batch_size": args.rows, "shuffle": False}))
        name = "packed" if packed else "padded"
        for phase, call in (("log_prob", actor.compute_log_prob), ("update", actor.update_actor)):
            call(batch)  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = call(batch)
                times.append(time.perf_counter() - t0)
            row[f"{name}_{phase}_s"] = statistics.median(times)
            row[f"{name}_{phase}_tokens_per_s"] = real / statistics.median(times)
            if phase == "update":
                row[f"{name}_padding_fraction"] = out[0]["actor/padding_fraction_after"][0]
        del actor
    Path(args.inner).write_text(json.dumps(row))


def predicted_bytes(model_dir: str, cp: int, seq: int, gpu: bool = False) -> int:
    """The planner's activations for one sequence: this CPU's kernels (its masks kept, K/V repeated to every head),
    or a GPU's (``gpu``: the fused kernels' causal offset without a mask, K/V at their groups)."""
    from controller.planner.memory import ActivationShape, stage_activation_bytes
    from hybridengine.model.spec import ModelSpec

    spec = ModelSpec.from_pretrained(model_dir).with_padded_vocab(128, 1)
    shape = ActivationShape(1, seq, PRECISION, flash_attention=gpu, context_parallel=cp, packed=True)
    return stage_activation_bytes(spec, 1, 1, 0, shape)


def run_memory(model_dir: Path, seq: int) -> list[dict]:
    rows = []
    for cp in (1, 2, 4):
        row = run_torchrun_job(__file__, cp, ["--part", "memory", "--model-dir", str(model_dir), "--seq", str(seq)],
                               f"memory CP{cp}")
        row["measured_bytes"] = max(row["bytes_per_rank"])
        row["predicted_bytes"] = predicted_bytes(str(model_dir), cp, seq)
        row["predicted_gpu_bytes"] = predicted_bytes(str(model_dir), cp, seq, gpu=True)
        rows.append(row)
    return rows


def run_grpo(steps: int, new_tokens: int) -> list[dict]:
    """hybridflow train, GRPO on 2 processes at CP1 (DP2) and CP2: step and update times."""
    rows = []
    for cp in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, "-m", "controller.cli", "train", "--config", "examples/ppo_tiny.yaml",
                       "model_path=builtin:tiny-chat", "algorithm.name=grpo", "trainer.launcher=torchrun",
                       "trainer.nproc=2", "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1",
                       f"actor.engine.context_parallel={cp}", "actor.engine.pack_sequences=true",
                       "actor.engine.micro_batch_size=1", "data.batch_size=4", "rollout.sampling.n=2",
                       "ppo.ppo_mini_batch_size=8", "ppo.ppo_epochs=1", "rollout.max_prompt_length=16",
                       f"rollout.sampling.max_new_tokens={new_tokens}", "rollout.sampling.ignore_eos=true",
                       f"trainer.total_steps={steps}", "trainer.val_every=0", "trainer.save_every=0",
                       "trainer.export_hf=false", "trainer.plots=false", "trainer.logger=[jsonl]",
                       f"trainer.run_dir={tmp}/run"]
            proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                                  env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
            if proc.returncode != 0:
                raise RuntimeError(f"GRPO CP{cp} failed:\n{proc.stderr[-3000:]}")
            metrics = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        later = metrics[1:] or metrics
        rows.append({"cp": cp, "steps": steps, "response_tokens": new_tokens,
                     "sequence_tokens": metrics[0]["response_length/mean"] + metrics[0].get("prompt_length/mean", 0),
                     "step_s": statistics.median(m["timing_s/step"] for m in later),
                     "update_actor_s": statistics.median(m["timing_s/update_actor"] for m in later),
                     "generation_s": statistics.median(m["timing_s/gen"] for m in later)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["memory", "throughput", "grpo"],
                        choices=["memory", "throughput", "grpo"])
    parser.add_argument("--seq", type=int, default=8192, help="memory: the sequence's tokens")
    parser.add_argument("--rows", type=int, default=32, help="throughput: rows in the batch")
    parser.add_argument("--median", type=int, default=96, help="throughput: the rows' median length")
    parser.add_argument("--longest", type=int, default=2048, help="throughput: the longest row")
    parser.add_argument("--budget", type=int, default=4096, help="throughput: max_tokens_per_micro_batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grpo-steps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=896, help="grpo: every response's length")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        return (inner_memory if args.part == "memory" else inner_throughput)(args)

    result: dict = {"precision": PRECISION, "model": SHAPES["tiny"]}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        make_checkpoint("tiny", model_dir, max_positions=max(args.seq, args.longest) * 2)
        if "memory" in args.parts:
            rows = result["memory"] = run_memory(model_dir, args.seq)
            print(f"\none sequence of {args.seq} tokens, rows packed ({PRECISION}): activations kept for backward, "
                  "busiest rank")
            print(f"{'CP':>3} {'measured MiB':>13} {'predicted MiB':>14} {'ratio':>6} {'vs CP1':>7} "
                  f"{'GPU predicted MiB':>18} {'vs CP1':>7}")
            for r in rows:
                print(f"{r['cp']:3d} {r['measured_bytes'] / 2**20:13.1f} {r['predicted_bytes'] / 2**20:14.1f} "
                      f"{r['predicted_bytes'] / r['measured_bytes']:6.3f} "
                      f"{r['measured_bytes'] / rows[0]['measured_bytes']:7.3f} "
                      f"{r['predicted_gpu_bytes'] / 2**20:18.1f} "
                      f"{r['predicted_gpu_bytes'] / rows[0]['predicted_gpu_bytes']:7.3f}")
        if "throughput" in args.parts:
            row = result["throughput"] = run_torchrun_job(
                __file__, 1, ["--part", "throughput", "--model-dir", str(model_dir), "--rows", str(args.rows),
                              "--median", str(args.median), "--longest", str(args.longest),
                              "--budget", str(args.budget), "--repeats", str(args.repeats)], "throughput")
            print(f"\n{args.rows} rows of long-tailed lengths (median {args.median}, longest {args.longest}, "
                  f"{row['real_tokens']} real tokens), max_tokens_per_micro_batch {args.budget}:")
            print(f"{'':8} {'update tok/s':>13} {'log_prob tok/s':>15} {'padding':>8}")
            for name in ("padded", "packed"):
                print(f"{name:8} {row[f'{name}_update_tokens_per_s']:13.0f} {row[f'{name}_log_prob_tokens_per_s']:15.0f} "
                      f"{row[f'{name}_padding_fraction']:8.3f}")
            print(f"packed / padded: update {row['packed_update_tokens_per_s'] / row['padded_update_tokens_per_s']:.2f}x, "
                  f"log_prob {row['packed_log_prob_tokens_per_s'] / row['padded_log_prob_tokens_per_s']:.2f}x")
    if "grpo" in args.parts:
        rows = result["grpo"] = run_grpo(args.grpo_steps, args.new_tokens)
        print(f"\nGRPO, 8 responses of {args.new_tokens} tokens a step on 2 processes (medians after step 1):")
        for r in rows:
            print(f"CP{r['cp']}: step {r['step_s']:.2f} s, update_actor {r['update_actor_s']:.2f} s, "
                  f"generation {r['generation_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
