"""Run under torchrun: twin actors, one with fixed micro-batches and one with a token budget, through
log-probs and one PPO update on the same batch; results to a file.

    torchrun --nproc-per-node N token_budget_program.py MODEL OUT --pp P --budget TOKENS
"""

import argparse
import os
from pathlib import Path

import torch

from controller import ResourcePool, WorkerGroup
from tiny_models import make_rl_batch
from workers import DataProto
from workers.actor import Actor


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
    g = torch.Generator().manual_seed(8)
    response_mask = batch.batch["response_mask"]
    batch = batch.union(DataProto({"advantages": torch.randn(response_mask.shape, generator=g) * response_mask,
                                   "old_log_probs": (-5 + torch.randn(response_mask.shape, generator=g)) * response_mask}))
    result = {"batch": batch}
    for name, engine in (("fixed", {"micro_batch_size": 2}), ("budget", {"max_tokens_per_micro_batch": args.budget})):
        actor = WorkerGroup(pool, Actor, role=name, kwargs=dict(
            model_path=args.model, engine={"precision": "fp32", "pipeline_parallel": args.pp, **engine},
            optim={"lr": 1e-3, "adam_eps": 1e-4}, ppo={"ppo_mini_batch_size": 16, "entropy_coeff": 0.01}))
        log_probs = actor.compute_log_prob(batch)
        metrics = actor.update_actor(batch)
        actor.to_generation(1, 1)
        result[name] = {"log_probs": log_probs, "metrics": metrics, "weights": actor.generation_weights()[0]}
        actor.to_training()
    torch.save(result, Path(args.out) / "result.pt")


if __name__ == "__main__":
    main()
