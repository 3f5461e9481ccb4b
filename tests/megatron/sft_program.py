"""Run under torchrun: one supervised step of the Actor on a TP/PP/DP layout, results to a file.

    torchrun --nproc-per-node N sft_program.py MODEL_DIR OUT_DIR --tp T --pp P
    torchrun --nproc-per-node N sft_program.py MODEL_DIR --cases CASES.json   (several layouts, one launch)

CASES.json: a list of {"out": OUT_DIR, "tp": T, "pp": P}, run in turn in the same processes.
"""

import argparse
import json
import os
from pathlib import Path

import torch

from controller import ResourcePool, WorkerGroup
from workers.actor import Actor
from controller.runtime.process_exit import exit_process


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--cases", help="a JSON list of layouts (see above), instead of OUT_DIR, --tp and --pp")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--lora", help="then a LoRA actor's step, its adapters from this PEFT adapter directory")
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--lora-alpha", type=float, default=8.0)
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    cases = json.loads(Path(args.cases).read_text()) if args.cases else [{"out": args.out, "tp": args.tp, "pp": args.pp}]
    for i, case in enumerate(cases):
        run_case(pool, args, case, f"_{i}" if args.cases else "")


def run_case(pool, args, case, suffix=""):
    """The full step, then (``--lora``) the LoRA step, at the case's layout, to case["out"]."""
    out, tp, pp = Path(case["out"]), case["tp"], case["pp"]
    batch = torch.load(out / "inputs.pt", weights_only=False)
    actor = WorkerGroup(pool, Actor, role=f"actor{suffix}", kwargs=dict(
        model_path=args.model,
        engine={"precision": "fp32", "tensor_parallel": tp, "pipeline_parallel": pp, "micro_batch_size": 2},
        optim={"lr": 1e-3, "clip_grad": 1.0, "adam_eps": 1e-4},
    ))
    before = actor.sft_eval(batch)
    metrics = actor.sft_step(batch)
    actor.save_hf(str(out / "after_step"))
    torch.save({"eval": before, "metrics": metrics, "layout": str(actor.layout), "state_bytes": actor.state_bytes()},
               out / "result.pt")
    if args.lora:  # the same step on LoRA adapters over the frozen base, in the same processes
        lora = WorkerGroup(pool, Actor, role=f"lora_actor{suffix}", kwargs=dict(
            model_path=args.model,
            engine={"precision": "fp32", "tensor_parallel": tp, "pipeline_parallel": pp, "micro_batch_size": 2},
            optim={"lr": 1e-3, "clip_grad": 1.0, "adam_eps": 1e-4},
            lora={"rank": args.lora_rank, "alpha": args.lora_alpha, "adapter_path": args.lora},
        ))
        before = lora.sft_eval(batch)
        reference = lora.compute_ref_log_prob(batch)  # the base: the adapters off
        metrics = lora.sft_step(batch)
        state = lora.state_bytes()  # after the step: Adam makes its state at its first
        lora.save_hf(str(out / "lora_merged"))
        lora.save_peft(str(out / "lora_adapter"))
        torch.save({"eval": before, "ref": reference, "metrics": metrics, "state_bytes": state}, out / "lora_result.pt")


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
