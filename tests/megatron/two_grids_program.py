"""Run under torchrun: an Actor and a RewardModel on the same processes, each on its own TP grid.

    torchrun --nproc-per-node 2 two_grids_program.py POLICY_DIR RM_DIR OUT_DIR --actor-tp A --reward-tp R

The reward model scores, the actor computes log-probs and takes a PPO step, the reward model
scores again (its grid must be untouched by the actor's), and the actor exports its weights.
Reads OUT_DIR/inputs.pt ({"batch", "train", "score_batch"}) and writes OUT_DIR/result.pt.
"""

import argparse
import os
from pathlib import Path

import torch

from controller import ResourcePool, WorkerGroup
from workers.actor import Actor
from workers.reward import RewardModel
from controller.runtime.process_exit import exit_process


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("policy")
    parser.add_argument("reward_model")
    parser.add_argument("out")
    parser.add_argument("--actor-tp", type=int, required=True)
    parser.add_argument("--reward-tp", type=int, required=True)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    out = Path(args.out)
    inputs = torch.load(out / "inputs.pt", weights_only=False)

    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    # The reward model's grid is built first, the actor's second: the actor's must not replace it.
    rm = WorkerGroup(pool, RewardModel, role="reward_model", kwargs={
        "model_path": args.reward_model,
        "engine": {"precision": "fp32", "tensor_parallel": args.reward_tp, "micro_batch_size": 1}})
    actor = WorkerGroup(pool, Actor, role="actor", kwargs=dict(
        model_path=args.policy,
        engine={"precision": "fp32", "tensor_parallel": args.actor_tp, "micro_batch_size": 2},
        optim={"lr": 1e-3, "clip_grad": 1.0, "adam_eps": 1e-4},
        ppo={"ppo_mini_batch_size": 8, "shuffle": False, "entropy_coeff": 0.01, "use_kl_loss": True,
             "kl_loss_coef": 0.1, "kl_loss_type": "k3", "loss_agg_mode": "token-mean"},
    ))
    scores_before = rm.compute_rm_score(inputs["score_batch"])
    batch = inputs["batch"]
    batch.meta_info["temperature"] = args.temperature
    log_probs = actor.compute_log_prob(batch)
    metrics = actor.update_actor(batch.union(inputs["train"]))
    scores_after = rm.compute_rm_score(inputs["score_batch"])
    actor.save_hf(str(out / "after_step"))
    torch.save({"log_probs": log_probs, "metrics": metrics, "scores_before": scores_before,
                "scores_after": scores_after, "layouts": (str(actor.layout), str(rm.layout))}, out / "result.pt")


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
