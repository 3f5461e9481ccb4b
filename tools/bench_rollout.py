"""Rollout throughput: vLLM and megatron generation through the hybrid engine, and HF generate.

    python tools/bench_rollout.py                          # tiny and ~100M models, both engines, t_g 1 and 2
    python tools/bench_rollout.py --models tiny --engines vllm --gen-tp 2 --json out.json

For each model, engine and generation TP a torchrun job (2 processes) builds
an Actor at TP2 and a colocated Rollout at generation TP t_g, then times
``generate_sequences`` on one batch of prompts (sampling at temperature 1,
every response ``max_new_tokens`` long): the median over repeats after one
warm-up call. A call reshards the actor's weights, syncs them into the
engine and generates; the phases are reported apart. HF transformers
``generate`` runs the same model and batch in one process as the reference
point. Tokens/s counts generated tokens.
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
    # name: (HF config overrides, prompts per batch, prompt length, new tokens)
    "tiny": (SHAPES["tiny"], 32, 32, 32),
    "100m": (SHAPES["100m"], 8, 32, 32),
}
ENGINES = ("vllm", "megatron")
PROCESSES = 2
TRAIN_TP = 2


def make_model(name: str, path: Path) -> int:
    return make_checkpoint(name, path, tokenizer=True)


def prompt_batch(name: str):
    from workers import DataProto

    _, batch, length, new_tokens = MODELS[name]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, MODELS[name][0]["vocab_size"], (batch, length), generator=g)
    sampling = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True, "seed": 0}
    return DataProto({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, meta_info={"sampling": sampling})


def inner(args) -> None:
    """Runs under torchrun: rank 0 is the controller."""
    from controller import ResourcePool, WorkerGroup
    from workers.actor import Actor
    from workers.rollout import Rollout

    _, batch_size, length, new_tokens = MODELS[args.model]
    pool = ResourcePool([PROCESSES])
    WorkerGroup(pool, Actor, role="actor", kwargs=dict(
        model_path=args.model_dir, engine={"tensor_parallel": TRAIN_TP, "micro_batch_size": 4}, optim={"lr": 1e-6}))
    rollout = WorkerGroup(pool, Rollout, role="rollout", kwargs=dict(model_path=args.model_dir, config={
        "engine": args.engine, "tensor_parallel": args.gen_tp, "max_prompt_length": length,
        "sampling": {"max_new_tokens": new_tokens}, "kv_cache_bytes": 256 << 20}))
    batch = prompt_batch(args.model)
    rollout.generate_sequences(batch)  # warm-up
    times, metrics = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = rollout.generate_sequences(batch)
        times.append(time.perf_counter() - t0)
        metrics.append(out.meta_info["metrics"])
    tokens = int(out.batch["response_mask"].sum())
    seconds = statistics.median(times)

    def median(key):
        return round(statistics.median(m.get(key, 0.0) for m in metrics), 4)

    row = {
        "model": args.model, "engine": args.engine, "gen_tp": args.gen_tp, "processes": PROCESSES,
        "prompts": batch_size, "new_tokens": tokens, "batch_s": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1), "gen_s": median("timing_s/gen"),
        "reshard_s": median("timing_s/reshard"), "weight_sync_s": median("timing_s/weight_sync"),
        "weight_sync_mib": round(median("weight_sync/bytes") / 2**20, 2),
    }
    Path(args.inner).write_text(json.dumps(row))


def hf_generate(name: str, model_dir: Path, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # more threads than free cores make every small matmul spin-wait
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = prompt_batch(name)
    _, batch_size, _, new_tokens = MODELS[name]
    ids = batch.batch["input_ids"]

    def run():
        torch.manual_seed(0)
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    tokens = (out.shape[1] - ids.shape[1]) * batch_size
    seconds = statistics.median(times)
    return {"model": name, "engine": "hf-generate", "gen_tp": 1, "processes": 1, "prompts": batch_size,
            "new_tokens": tokens, "batch_s": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "gen_s": round(seconds, 4), "reshard_s": 0.0, "weight_sync_s": 0.0, "weight_sync_mib": 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--gen-tp", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate reference")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        args.gen_tp = args.gen_tp[0]
        return inner(args)

    rows, sizes = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            model_dir = Path(tmp) / model
            sizes[model] = make_model(model, model_dir)
            for engine in args.engines:
                for gen_tp in args.gen_tp:
                    rows.append(run_torchrun_job(
                        __file__, PROCESSES,
                        ["--model", model, "--model-dir", str(model_dir), "--engine", engine,
                         "--gen-tp", str(gen_tp), "--repeats", str(args.repeats)],
                        f"{model} {engine} t_g={gen_tp}",
                    ))
            if not args.no_hf:
                rows.append(hf_generate(model, model_dir, args.repeats))

    header = (f"{'model':6} {'params':>7} {'engine':11} {'t_g':>3} {'prompts':>7} {'tokens':>6} {'batch s':>8} "
              f"{'tok/s':>8} {'gen s':>7} {'reshard s':>9} {'sync s':>7} {'sync MiB':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:6} {sizes[r['model']] / 1e6:6.1f}M {r['engine']:11} {r['gen_tp']:3d} {r['prompts']:7d} "
              f"{r['new_tokens']:6d} {r['batch_s']:8.3f} {r['tokens_per_s']:8.0f} {r['gen_s']:7.3f} "
              f"{r['reshard_s']:9.4f} {r['weight_sync_s']:7.4f} {r['weight_sync_mib']:8.2f}")
    print(f"(2 processes on this machine, actor at TP{TRAIN_TP}; t_g=1 runs two generation replicas; "
          f"HF generate runs in 1 process, 1 thread; medians)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "params": sizes}, indent=2))


if __name__ == "__main__":
    main()
