"""Run under torchrun: twin actors, one with fixed micro-batches and one with a token budget, through
log-probs and one PPO update on the same batch; results to a file.

    torchrun --nproc-per-node N token_budget_program.py MODEL OUT --pp P --budget TOKENS
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--budget", type=int, required=True)
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    # Rows of very different lengths: 2-14 prompt tokens, 1-8 response tokens.
    batch = make_rl_batch(batch_size=16, prompt_length=14, response_length=8, seed=7)
    mask = batch.batch["attention_mask"]
    for row in range(16):
        mask[row, : (row * 5) % 13] = 0
    batch.batch["input_ids"] *= mask
    batch.batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = with_ppo_inputs(batch, seed=8)
    result = {"batch": batch}
    for name, engine in (("fixed", {"micro_batch_size": 2}), ("budget", {"max_tokens_per_micro_batch": args.budget})):
        actor = WorkerGroup(pool, Actor, role=name, kwargs=dict(
            model_path=args.model, engine={"precision": "fp32", "pipeline_parallel": args.pp, **engine},
            optim={"lr": 1e-3, "adam_eps": 1e-4}, ppo={"ppo_mini_batch_size": 16, "entropy_coeff": 0.01}))
        log_probs = actor.compute_log_prob(batch)
        result[name] = {"log_probs": log_probs, "metrics": actor.update_actor(batch), "weights": whole_weights(actor)}
    torch.save(result, Path(args.out) / "result.pt")


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
