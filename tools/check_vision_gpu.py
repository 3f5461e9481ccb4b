"""A vision-language model on the GPU: the megatron actor's forward and backward against transformers on the device.

    python tools/check_vision_gpu.py --json vision.json     # cuda:0: fp32, then bf16 (a torchrun job of one process)
    python tools/check_vision_gpu.py --allow-cpu            # the same on the CPU (a dry run)

A small random Qwen2.5-VL (``examples/vision/colour_task.py``'s: two decoder layers, a two-block vision tower) on
the colour-square images (made here, no files: transformers and pillow only), its tower trained: the actor's log-probs (the language model with mrope, transformers'
tower and merger, the image embeddings scattered in) and the gradient norm of one policy-gradient step (advantage 1,
ratio 1: the gradient of the token-mean log-prob), each against transformers' model on the same device and inputs.
Prints and writes, per precision, the largest log-prob difference and the gradient norms' relative difference.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.torchrun_job import device_check_args, run_torchrun_job  # noqa: E402

TOLERANCE = {"fp32": dict(log_prob=1e-3, grad_norm=1e-3), "bf16": dict(log_prob=0.1, grad_norm=0.05)}


def colour_task() -> dict:
    """``examples/vision/colour_task.py``'s functions (its model and images need transformers and pillow only)."""
    return runpy.run_path(str(ROOT / "examples" / "vision" / "colour_task.py"))


def make_batch(task: Path, rows: int, response: int, seed: int = 0):
    """``rows`` image prompts of the colour task with random responses, as a rollout hands them to the actor."""
    import random

    from transformers import AutoTokenizer

    from controller.data.chat_template import PromptFormat, encode_prompts
    from controller.data.dataset import rows_to_dataset
    from controller.data.images import ImageProcessing
    from controller.data.loader import PromptLoader
    from workers import DataProto

    model, functions, rng = task / "model", colour_task(), random.Random(seed)
    tokenizer, images = AutoTokenizer.from_pretrained(model), ImageProcessing.for_model(model)
    table = []
    for _ in range(rows):
        square, circle = rng.sample(sorted(functions["COLOURS"]), 2)
        table.append({"prompt": [{"role": "user", "content": functions["QUESTION"]}],
                      "images": [functions["draw"](square, circle, rng.random() < 0.5)], "ground_truth": square})
    data = encode_prompts(rows_to_dataset(table), tokenizer, PromptFormat(), images=images)
    prompts = PromptLoader(data, tokenizer, rows, None, shuffle=False, images=images).batch(list(range(rows)))
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(3, 98, (rows, response), generator=g)  # printable characters
    response_mask = torch.ones_like(responses)
    attention = torch.cat([prompts.batch["attention_mask"], response_mask], 1)
    return DataProto({"input_ids": torch.cat([prompts.batch["input_ids"], responses], 1), "attention_mask": attention,
                      "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "responses": responses,
                      "response_mask": response_mask}, dict(prompts.non_tensor_batch), {"temperature": 1.0})


def hf_reference(model_dir: Path, batch, device, dtype) -> tuple[torch.Tensor, float]:
    """transformers' log-probs of the responses and the gradient norm of their token mean (every weight trained)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device)
    b, rows = batch.batch, [r for r in batch.non_tensor_batch["multi_modal_inputs"] if r is not None]
    ids = b["input_ids"].to(device)
    logits = model(ids, attention_mask=b["attention_mask"].to(device),
                   pixel_values=torch.cat([r["pixel_values"] for r in rows]).to(device, dtype),
                   image_grid_thw=torch.cat([r["image_grid_thw"] for r in rows]).to(device),
                   mm_token_type_ids=(ids == model.config.image_token_id).int()).logits.float()
    length = b["responses"].shape[1]
    log_p = torch.log_softmax(logits[:, -length - 1:-1], -1).gather(-1, b["responses"].to(device)[..., None])[..., 0]
    (-log_p.mean()).backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return log_p.detach().cpu(), float(norm)


def inner(args) -> dict:
    from controller import ResourcePool, WorkerGroup
    from hybridengine.device import accelerator_available
    from workers import DataProto
    from workers.actor import Actor

    device = torch.device("cuda", 0) if accelerator_available() else torch.device("cpu")
    task = Path(args.task)
    batch = make_batch(task, args.batch, args.response)
    results = {"device": str(device), "sequences": args.batch, "seq_len": int(batch.batch["input_ids"].shape[1])}
    pool = ResourcePool([1])
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        actor = WorkerGroup(pool, Actor, role=f"actor_{precision}", kwargs=dict(
            model_path=str(task / "model"), engine={"precision": precision, "micro_batch_size": 4},
            optim={"lr": 1e-6, "clip_grad": 0.0}, freeze_vision_tower=False,
            ppo={"ppo_mini_batch_size": args.batch, "shuffle": False, "loss_agg_mode": "token-mean"}))
        old = actor.compute_log_prob(batch).batch["old_log_probs"]
        hf, hf_norm = hf_reference(task / "model", batch, device, dtype)
        difference = float((old - hf).abs().max())
        train = batch.union(DataProto({"old_log_probs": old, "advantages": torch.ones_like(old)}))
        norm = actor.update_actor(train)[0]["actor/grad_norm"][0]
        relative = abs(norm - hf_norm) / hf_norm
        limits = TOLERANCE[precision]
        results[precision] = {"max_abs_log_prob_difference": difference, "grad_norm": norm, "hf_grad_norm": hf_norm,
                              "grad_norm_relative_difference": relative,
                              "ok": difference <= limits["log_prob"] and relative <= limits["grad_norm"]}
    return results


def main() -> int:
    args = device_check_args(__doc__, inner, {"batch": (int, 16), "response": (int, 16)}, ("task",))
    if args is None:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        task = Path(tmp) / "task"
        (task / "model").mkdir(parents=True)
        colour_task()["tiny_model"](task / "model", 0)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # an installed set too
        results = run_torchrun_job(__file__, 1, ["--task", str(task), "--batch", str(args.batch), "--response",
                                                 str(args.response)], "the vision check", env={"PYTHONPATH": path})
    for precision in ("fp32", "bf16"):
        r = results[precision]
        print(f"{precision}: log-prob difference from HF {r['max_abs_log_prob_difference']:.2e}, gradient norm "
              f"{r['grad_norm']:.5g} vs HF's {r['hf_grad_norm']:.5g} ({r['grad_norm_relative_difference']:.2e} "
              f"relative; tolerances {TOLERANCE[precision]})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(results[p]["ok"] for p in ("fp32", "bf16")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
