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
    args = parser.parse_args()
    out = Path(args.out)
    batch = torch.load(out / "inputs.pt", weights_only=False)
    actor = WorkerGroup(ResourcePool([int(os.environ["WORLD_SIZE"])]), Actor, role="actor", kwargs=dict(
        model_path=args.model,
        engine={"precision": "fp32", "tensor_parallel": args.tp, "pipeline_parallel": args.pp, "micro_batch_size": 2},
        optim={"lr": 1e-3, "clip_grad": 1.0, "adam_eps": 1e-4},
    ))
    before = actor.sft_eval(batch)
    metrics = actor.sft_step(batch)
    actor.save_hf(str(out / "after_step"))
    torch.save({"eval": before, "metrics": metrics, "layout": str(actor.layout)}, out / "result.pt")


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
