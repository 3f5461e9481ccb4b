"""Run under torchrun: one PPO update without, with full and with selective activation recomputation, on
triplet actors (same weights); results to a file.

    torchrun --nproc-per-node N recompute_program.py MODEL OUT
"""

import argparse
import os
from pathlib import Path

import torch

from controller import ResourcePool, WorkerGroup
from actor_inputs import whole_weights, with_ppo_inputs
from tiny_models import make_rl_batch
from workers.actor import Actor
from controller.runtime.process_exit import exit_process

SETTINGS = {"none": {}, "full": {"recompute_granularity": "full", "recompute_num_layers": 2},
            "selective": {"recompute_granularity": "selective"}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    batch = with_ppo_inputs(make_rl_batch(seed=3), seed=4)
    result = {}
    for name, setting in SETTINGS.items():
        actor = WorkerGroup(pool, Actor, role=name, kwargs=dict(
            model_path=args.model, engine={"precision": "fp32", "micro_batch_size": 2, **setting},
            optim={"lr": 1e-3, "adam_eps": 1e-4}, ppo={"ppo_mini_batch_size": len(batch)}))
        result[name] = {"metrics": actor.update_actor(batch), "weights": whole_weights(actor)}
    torch.save(result, Path(args.out) / "result.pt")


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
