"""Packed sequences and context parallelism on the GPU: the megatron actor against transformers on the device.

    python tools/check_long_context_gpu.py --json context.json    # cuda: packed rows (one process), fp32 then bf16
    python tools/check_long_context_gpu.py --allow-cpu            # the same on the CPU (a dry run), and CP2

A small random Llama (``tools/bench_models``' tiny shape, GQA) on rows of long-tailed lengths (up to ``--longest``
tokens): the actor's log-probs with its rows padded and packed (the engine's own attention: torch's fused
kernels with each row's causal mask, no attention across rows), and the gradient norm of one policy-gradient
step (advantage 1: the gradient of the token-mean log-prob), each against transformers' model on the same device.
Context parallelism (each row over two processes, K/V all-gathered) runs where two devices are visible (two
GPUs, or the CPU's processes): one GPU cannot hold an NCCL group of two ranks.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_long_context import long_tailed_batch  # noqa: E402
from tools.bench_models import SHAPES, make_checkpoint  # noqa: E402
from tools.torchrun_job import device_check_args, run_torchrun_job  # noqa: E402

TOLERANCE = {"fp32": dict(log_prob=1e-3, grad_norm=1e-3), "bf16": dict(log_prob=0.1, grad_norm=0.05)}


def hf_reference(model_dir: str, batch, device, dtype) -> tuple[torch.Tensor, float]:
    """transformers' log-probs of the responses (eager attention, the padding masked) and the gradient norm of
    their token mean."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device)
    b = batch.batch
    logits = model(b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device),
                   position_ids=b["position_ids"].to(device)).logits.float()
    length = b["responses"].shape[1]
    log_p = torch.log_softmax(logits[:, -length - 1:-1], -1).gather(-1, b["responses"].to(device)[..., None])[..., 0]
    mask = b["response_mask"].to(device)
    (-(log_p * mask).sum() / mask.sum()).backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return log_p.detach().cpu(), float(norm)


def inner(args) -> dict:
    import os

    from controller import ResourcePool, WorkerGroup
    from hybridengine.device import accelerator_available
    from workers import DataProto
    from workers.actor import Actor

    nproc = int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", 0) if accelerator_available() else torch.device("cpu")
    rows, real = long_tailed_batch(SHAPES["tiny"]["vocab_size"], args.rows, args.longest // 8, args.longest, 16)
    batch = DataProto({k: v for k, v in rows.batch.items() if k not in ("old_log_probs", "advantages")},
                      meta_info={"temperature": 1.0})
    mask = batch.batch["response_mask"].bool()
    results = {"device": str(device), "rows": args.rows, "real_tokens": real, "longest": args.longest,
               "context_parallel": nproc}
    pool = ResourcePool([nproc])
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf, hf_norm = hf_reference(args.model_dir, batch, device, dtype)
        figures = {"hf_grad_norm": hf_norm}
        layouts = [("padded", False), ("packed", True)] if nproc == 1 else [("cp", True)]
        for name, packed in layouts:
            actor = WorkerGroup(pool, Actor, role=f"actor_{precision}_{name}", kwargs=dict(
                model_path=args.model_dir, optim={"lr": 1e-6, "clip_grad": 0.0},
                engine={"precision": precision, "max_tokens_per_micro_batch": args.longest * 2,
                        "pack_sequences": packed, "context_parallel": nproc},
                ppo={"ppo_mini_batch_size": args.rows, "shuffle": False, "loss_agg_mode": "token-mean"}))
            old = actor.compute_log_prob(batch).batch["old_log_probs"]
            train = batch.union(DataProto({"old_log_probs": old, "advantages": torch.ones_like(old)}))
            norm = actor.update_actor(train)[0]["actor/grad_norm"][0]
            figures[name] = {"max_abs_log_prob_difference": float((old - hf)[mask].abs().max()), "grad_norm": norm,
                             "grad_norm_relative_difference": abs(norm - hf_norm) / hf_norm}
        limits = TOLERANCE[precision]
        figures["ok"] = all(figures[name]["max_abs_log_prob_difference"] <= limits["log_prob"]
                            and figures[name]["grad_norm_relative_difference"] <= limits["grad_norm"]
                            for name, _ in layouts)
        results[precision] = figures
    return results


def main() -> int:
    args = device_check_args(__doc__, inner, {"rows": (int, 16), "longest": (int, 1024)}, ("model_dir",))
    if args is None:
        return 0
    from hybridengine.device import accelerator_available, accelerator_count

    runs = [1] + ([2] if not accelerator_available() or accelerator_count() >= 2 else [])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        make_checkpoint("tiny", model, max_positions=args.longest * 2)
        for nproc in runs:
            results[f"cp{nproc}"] = run_torchrun_job(__file__, nproc, [
                "--model-dir", str(model), "--rows", str(args.rows), "--longest", str(args.longest)],
                f"the long-context check on {nproc} process(es)")
    for key, r in results.items():
        for precision in ("fp32", "bf16"):
            for name in ("padded", "packed", "cp"):
                if name in r[precision]:
                    f = r[precision][name]
                    print(f"{key} {precision} {name}: log-prob difference from HF {f['max_abs_log_prob_difference']:.2e}, "
                          f"gradient norm {f['grad_norm_relative_difference']:.2e} relative "
                          f"(tolerances {TOLERANCE[precision]})")
    if len(runs) == 1:
        print("context parallelism not run: one GPU visible (an NCCL group needs a device per rank)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r[p]["ok"] for r in results.values() for p in ("fp32", "bf16")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
