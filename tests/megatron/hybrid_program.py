"""Run under torchrun (4 ranks): reshard a trained actor for generation with all three methods,
return to training, and train on; a twin actor that never reshards trains beside it."""

import argparse
import os

import torch

from controller import ResourcePool, WorkerGroup
from resume_program import batch_for
from workers.actor import Actor
from controller.runtime.process_exit import exit_process


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--gen-tp", type=int, default=1)
    parser.add_argument("--gen-pp", type=int, default=1)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    kwargs = dict(model_path=args.model, engine={"precision": args.precision, "tensor_parallel": args.tp, "pipeline_parallel": args.pp, "micro_batch_size": 2},
                  optim={"lr": 1e-3, "adam_eps": 1e-4}, ppo={"ppo_mini_batch_size": 4})
    actor = WorkerGroup(pool, Actor, role="actor", kwargs=kwargs)
    twin = WorkerGroup(pool, Actor, role="twin", kwargs=kwargs)
    result = {"first": [actor.update_actor(batch_for(0)), twin.update_actor(batch_for(0))]}
    actor.save_hf(os.path.join(args.out, "trained"))
    for method in ("micro_dp", "full_allgather", "tp_pp_gather"):
        stats = actor.to_generation(args.gen_tp, args.gen_pp, method, release_training=method == "micro_dp")
        result[method] = {"stats": stats, "weights": actor.generation_weights()}
    result["back"] = actor.to_training()
    result["second"] = [actor.update_actor(batch_for(1)), twin.update_actor(batch_for(1))]
    torch.save(result, os.path.join(args.out, "hybrid.pt"))


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
