"""Run under torchrun: one PPO update with the old log-probs recomputed, and one with them taken from the
update's own forward, on twin actors (same weights), in fp32 and bf16; results to a file.

    torchrun --nproc-per-node N old_log_prob_program.py MODEL OUT
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
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    batch = with_ppo_inputs(make_rl_batch(seed=5), seed=6, old_log_probs=False, rollout_log_probs=True)
    batch.meta_info["temperature"] = 0.8
    result = {}
    for precision in ("fp32", "bf16"):
        kwargs = dict(model_path=args.model, engine={"precision": precision, "micro_batch_size": 2},
                      optim={"lr": 1e-3, "adam_eps": 1e-4},
                      ppo={"ppo_mini_batch_size": len(batch), "entropy_coeff": 0.01})
        recompute = WorkerGroup(pool, Actor, role=f"recompute_{precision}", kwargs=kwargs)
        from_update = WorkerGroup(pool, Actor, role=f"from_update_{precision}", kwargs=kwargs)
        old = recompute.compute_log_prob(batch)
        recompute_metrics = recompute.update_actor(batch.union(old))
        update_metrics = from_update.update_actor(batch, old_log_probs_from_update=True)
        result[precision] = {
            "old_log_probs": old.batch["old_log_probs"], "recompute": recompute_metrics, "from_update": update_metrics,
            "weights": [whole_weights(recompute), whole_weights(from_update)],
        }
    result["batch"] = batch
    # Not on-policy: two mini-batches. The actor refuses to take old log-probs from the update.
    two = WorkerGroup(pool, Actor, role="two_mini_batches", kwargs=dict(
        model_path=args.model, engine={"precision": "fp32", "micro_batch_size": 2}, ppo={"ppo_mini_batch_size": len(batch) // 2}))
    try:
        two.update_actor(batch, old_log_probs_from_update=True)
        result["refusal"] = None
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        result["refusal"] = str(error)
    torch.save(result, Path(args.out) / "result.pt")


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
