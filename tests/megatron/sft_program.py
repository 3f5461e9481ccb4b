"""Run under torchrun: one supervised step of the Actor on a TP/PP/DP layout, results to a file.

    torchrun --nproc-per-node N sft_program.py MODEL_DIR OUT_DIR --tp T --pp P
"""

import argparse
import os
from pathlib import Path

import torch

from controller import ResourcePool, WorkerGroup
from workers.actor import Actor
from controller.runtime.process_exit import exit_process


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--lora", help="then a LoRA actor's step, its adapters from this PEFT adapter directory")
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--lora-alpha", type=float, default=8.0)
    args = parser.parse_args()
    out = Path(args.out)
    batch = torch.load(out / "inputs.pt", weights_only=False)
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    actor = WorkerGroup(pool, Actor, role="actor", kwargs=dict(
        model_path=args.model,
        engine={"precision": "fp32", "tensor_parallel": args.tp, "pipeline_parallel": args.pp, "micro_batch_size": 2},
        optim={"lr": 1e-3, "clip_grad": 1.0, "adam_eps": 1e-4},
    ))
    before = actor.sft_eval(batch)
    metrics = actor.sft_step(batch)
    actor.save_hf(str(out / "after_step"))
    torch.save({"eval": before, "metrics": metrics, "layout": str(actor.layout), "state_bytes": actor.state_bytes()},
               out / "result.pt")
    if args.lora:  # the same step on LoRA adapters over the frozen base, in the same processes
        lora = WorkerGroup(pool, Actor, role="lora_actor", kwargs=dict(
            model_path=args.model,
            engine={"precision": "fp32", "tensor_parallel": args.tp, "pipeline_parallel": args.pp, "micro_batch_size": 2},
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
