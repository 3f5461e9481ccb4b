"""Run under torchrun: a RewardModel group on one TP/PP layout scores a batch; results to a file.

    torchrun --nproc-per-node N reward_model_program.py MODEL_DIR OUT_DIR --tp T --pp P [--score-key KEY]

Reads OUT_DIR/inputs.pt ({"batch": DataProto}) and writes OUT_DIR/result.pt.
"""

import argparse
import os
from pathlib import Path

import torch

from controller import ResourcePool, WorkerGroup
from workers.reward import RewardModel
from controller.runtime.process_exit import exit_process


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--score-key", default="rm_scores")
    args = parser.parse_args()
    out = Path(args.out)

    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    engine = {"precision": "fp32", "tensor_parallel": args.tp, "pipeline_parallel": args.pp, "micro_batch_size": args.micro_batch_size}
    rm = WorkerGroup(pool, RewardModel, role="reward_model",
                     kwargs={"model_path": args.model, "engine": engine, "score_key": args.score_key})
    batch = torch.load(out / "inputs.pt", weights_only=False)["batch"]
    scored = rm.compute_rm_score(batch)
    torch.save({"scored": scored, "layout": str(rm.layout)}, out / "result.pt")


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
