"""Training-engine throughput: compute_log_prob and update_actor at several layouts.

    python tools/bench_train.py                     # tiny and ~100M models, TP1 TP2 PP2 DP2 TP2xPP2
    python tools/bench_train.py --models tiny --layouts TP2 --json out.json

For each model and layout a torchrun job builds the Actor from a random HF
checkpoint, then times compute_log_prob (forward only) and update_actor (one
PPO mini-batch: forward, backward, Adam step) on the same batch. Printed:
tokens/s of each (median over repeats, after one warm-up call) and the peak
resident memory of each process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_models import SHAPES, make_checkpoint  # noqa: E402
from tools.torchrun_job import run_torchrun_job  # noqa: E402

MODELS = {
    # name: (HF config overrides, batch size, prompt length, response length)
    "tiny": (SHAPES["tiny"], 16, 64, 64),
    "100m": (SHAPES["100m"], 4, 64, 64),
}
LAYOUTS = {"TP1": (1, 1, 1), "TP2": (2, 1, 2), "PP2": (1, 2, 2), "DP2": (1, 1, 2), "TP2xPP2": (2, 2, 4)}


def make_model(name: str, path: Path) -> int:
    return make_checkpoint(name, path, tokenizer=False)


def make_batch(vocab: int, batch: int, prompt: int, response: int):
    from workers import DataProto

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    return DataProto({
        "input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
        "responses": ids[:, prompt:], "response_mask": mask[:, prompt:],
        "old_log_probs": torch.full((batch, response), -5.0),
        "advantages": torch.randn(batch, response, generator=g),
    })


def inner(args) -> None:
    """Runs under torchrun: rank 0 is the controller."""
    from controller import ResourcePool, WorkerGroup
    from workers.actor import Actor

    tp, pp, nproc = LAYOUTS[args.layout]
    _, batch_size, prompt, response = MODELS[args.model]
    vocab = MODELS[args.model][0]["vocab_size"]
    pool = ResourcePool([nproc])
    actor = WorkerGroup(pool, Actor, role="actor", kwargs=dict(
        model_path=args.model_dir,
        engine={"tensor_parallel": tp, "pipeline_parallel": pp, "micro_batch_size": 2},
        optim={"lr": 1e-6},
        ppo={"ppo_mini_batch_size": batch_size, "shuffle": False},
    ))
    batch = make_batch(vocab, batch_size, prompt, response)
    tokens = batch_size * (prompt + response)
    timings = {}
    for name, call in (("log_prob", actor.compute_log_prob), ("update", actor.update_actor)):
        call(batch)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call(batch)
            times.append(time.perf_counter() - t0)
        timings[name] = statistics.median(times)
    rss = [info["max_rss_mb"] for info in actor.worker_info()]
    row = {
        "model": args.model, "layout": args.layout, "processes": nproc, "tokens_per_batch": tokens,
        "log_prob_tokens_per_s": round(tokens / timings["log_prob"], 1),
        "update_tokens_per_s": round(tokens / timings["update"], 1),
        "log_prob_s": round(timings["log_prob"], 3), "update_s": round(timings["update"], 3),
        "peak_rss_mb_per_process": [round(r) for r in rss],
    }
    Path(args.inner).write_text(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        return inner(args)

    rows, sizes = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            model_dir = Path(tmp) / model
            sizes[model] = make_model(model, model_dir)
            for layout in args.layouts:
                rows.append(run_torchrun_job(
                    __file__, LAYOUTS[layout][2],
                    ["--model", model, "--model-dir", str(model_dir), "--layout", layout, "--repeats", str(args.repeats)],
                    f"{model} {layout}",
                ))

    header = f"{'model':6} {'params':>7} {'layout':8} {'procs':>5} {'log_prob tok/s':>14} {'update tok/s':>12} {'peak RSS MB/proc':>17}"
    print(header)
    print("-" * len(header))
    for r in rows:
        rss = max(r["peak_rss_mb_per_process"])
        print(f"{r['model']:6} {sizes[r['model']] / 1e6:6.1f}M {r['layout']:8} {r['processes']:5d} "
              f"{r['log_prob_tokens_per_s']:14.0f} {r['update_tokens_per_s']:12.0f} {rss:17.0f}")
    print("(tokens/s counts prompt + response tokens of the batch; medians; peak RSS is the largest process)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "params": sizes}, indent=2))


if __name__ == "__main__":
    main()
