"""A mixture of experts on the GPU: the megatron actor's log-probs against HF transformers on the same device.

    python tools/check_moe_gpu.py --json moe.json          # cuda:0: fp32, then bf16 (a torchrun job of one process)
    python tools/check_moe_gpu.py --allow-cpu               # the same on the CPU (a dry run)

The built-in Qwen3-MoE (builtin:tiny-arithmetic-moe: 8 experts, 2 per token) goes through the MoE path the
GPU takes: megatron's router and token dispatcher on CUDA tensors, the experts as a sequential MLP (or
transformer-engine's grouped GEMM where it is installed). Prints and writes, per precision, the largest
log-prob difference from HF's model on the same tokens, the update's tokens/s and the routing figures; then
the megatron rollout engine colocated with the fp32 actor (the 3D-HybridEngine over experts on the device)
generates greedily, and must equal HF's greedy on the actor's exported weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_train import make_batch  # noqa: E402
from tools.torchrun_job import device_check_args  # noqa: E402

TOLERANCE = {"fp32": 1e-3, "bf16": 0.1}  # fp32 on the GPU: TF32-free matmuls, kernels' own sums; bf16: rounding


def hf_log_probs(model_dir: str, batch, device, dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    b = batch.batch
    with torch.no_grad():
        logits = model(b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)).logits.float()
    length = b["responses"].shape[1]
    log_p = torch.log_softmax(logits[:, -length - 1:-1], -1)
    return log_p.gather(-1, b["responses"].to(device).unsqueeze(-1)).squeeze(-1).cpu()


def inner(args) -> dict:
    from controller import ResourcePool, WorkerGroup
    from hybridengine.device import accelerator_available
    from workers.actor import Actor

    device = torch.device("cuda", 0) if accelerator_available() else torch.device("cpu")
    batch = make_batch(256, args.batch, args.prompt, args.response)
    batch.meta_info["temperature"] = 1.0
    tokens = args.batch * (args.prompt + args.response)
    results = {"device": str(device), "sequences": args.batch, "seq_len": args.prompt + args.response}
    pool = ResourcePool([1])
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        actor = WorkerGroup(pool, Actor, role=f"actor_{precision}", kwargs=dict(
            model_path=args.model_dir, engine={"precision": precision, "micro_batch_size": 4,
                                               "moe_aux_loss_coeff": 0.01},
            optim={"lr": 1e-5}, ppo={"ppo_mini_batch_size": args.batch, "shuffle": False}))
        got = actor.compute_log_prob(batch).batch["old_log_probs"]
        difference = float((got - hf_log_probs(args.model_dir, batch, device, dtype)).abs().max())
        start = time.perf_counter()
        metrics = actor.update_actor(batch)[0]
        seconds = time.perf_counter() - start
        results[precision] = {
            "max_abs_log_prob_difference": difference, "ok": difference <= TOLERANCE[precision],
            "update_tokens_per_s": round(tokens / seconds, 1), "grad_norm": metrics["actor/grad_norm"][0],
            **{key.removeprefix("actor/"): values[0] for key, values in metrics.items()
               if key.startswith("actor/moe/") and "/layer_" not in key},
        }
        print(f"{precision}: log-prob difference from HF {difference:.2e} (tolerance {TOLERANCE[precision]}); "
              f"update {results[precision]['update_tokens_per_s']} tokens/s")
        if precision == "fp32":
            results["generation"] = generation_check(pool, actor, f"actor_{precision}", device, args)
    return results


def generation_check(pool, actor, actor_role: str, device, args) -> dict:
    """The 3D-HybridEngine over experts on the device: the megatron rollout engine colocated with the updated
    fp32 actor generates greedily; its tokens must equal HF's greedy on the actor's exported weights, and the
    experts it reports for every position (rollout routing replay's routes) HF's routers' top-k."""
    from transformers import AutoModelForCausalLM

    from controller import WorkerGroup
    from workers import DataProto
    from workers.rollout import Rollout

    rollout = WorkerGroup(pool, Rollout, role=f"rollout_{actor_role}", kwargs=dict(
        model_path=args.model_dir, actor_role=actor_role,
        config={"engine": "megatron", "max_prompt_length": 8, "sampling": {"max_new_tokens": 8},
                "return_routed_experts": True}))
    prompts = [[5, 9, 33, 7], [100, 4, 3, 12], [44, 45, 46, 47], [7, 8, 9, 10]]
    ids = torch.tensor(prompts)
    batch = DataProto({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {}, {"sampling": {"greedy": True,
                                                                                                 "ignore_eos": True}})
    start = time.perf_counter()
    out = rollout.generate_sequences(batch)
    seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as exported:
        actor.save_hf(exported)
        hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).to(device)
        with torch.no_grad():
            expected = hf.generate(ids.to(device), do_sample=False, max_new_tokens=8, eos_token_id=None,
                                   pad_token_id=0)[:, ids.shape[1]:].cpu()
            sequences = torch.cat([ids, expected], 1).to(device)
            logits = hf(sequences, output_router_logits=True).router_logits  # per layer, [rows x positions, experts]
    got = out.batch["responses"]
    metrics = out.meta_info["metrics"]
    equal = bool(torch.equal(got, expected))
    routes = out.batch["rollout_routed_experts"][:, :-1].long()  # every position but the last token's
    k = routes.shape[-1]
    hf_routes = torch.stack([layer.topk(k, -1).indices.sort(-1).values.cpu().reshape(*sequences.shape, k)
                             for layer in logits], 2)[:, :-1]
    routes_equal = bool(torch.equal(routes, hf_routes))
    print(f"generation: megatron rollout greedy {'equals' if equal else 'DIFFERS FROM'} HF's after the reshard "
          f"({metrics.get('reshard/expert_bytes_received', 0):.0f} expert bytes received); {seconds:.2f} s; its "
          f"routes {'equal' if routes_equal else 'DIFFER FROM'} HF's routers' top-k")
    return {"ok": equal and routes_equal, "greedy_equals_hf": equal, "routes_equal_hf": routes_equal,
            "seconds": round(seconds, 3), "expert_bytes_received": metrics.get("reshard/expert_bytes_received")}


def main() -> int:
    args = device_check_args(__doc__, inner, {"batch": (int, 16), "prompt": (int, 48), "response": (int, 16)},
                             ("model_dir",))
    if args is None:
        return 0
    from controller.models.builtin import resolve_model_path

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = resolve_model_path("builtin:tiny-arithmetic-moe", tmp)
        out = Path(tmp) / "moe.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__,
                   "--inner", str(out), "--model-dir", model_dir, "--batch", str(args.batch),
                   "--prompt", str(args.prompt), "--response", str(args.response)]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        code = subprocess.call(command, env={**os.environ, "PYTHONPATH": path})
        if code != 0 or not out.exists():
            raise SystemExit(f"the torchrun job failed (exit code {code})")
        results = json.loads(out.read_text())
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(results[p]["ok"] for p in ("fp32", "bf16", "generation")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
