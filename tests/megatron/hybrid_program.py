"""Run under torchrun (4 ranks): reshard a trained actor for generation with all three methods,
return to training, and train on; a twin actor that never reshards trains beside it. ``--cases``: several such
runs in one launch."""

import argparse
import json
import os
from pathlib import Path

import torch

from controller import ResourcePool, WorkerGroup
from resume_program import batch_for
from workers.actor import Actor
from controller.runtime.process_exit import exit_process


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--gen-tp", type=int, default=1)
    parser.add_argument("--gen-pp", type=int, default=1)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--cases", help="a JSON list of {model, out, tp, pp, gen_tp, gen_pp, precision}, run in turn "
                                        "(each its own actor and twin on the same processes), instead of the above")
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    cases = json.loads(Path(args.cases).read_text()) if args.cases else [
        {"model": args.model, "out": args.out, "tp": args.tp, "pp": args.pp, "gen_tp": args.gen_tp,
         "gen_pp": args.gen_pp, "precision": args.precision}]
    for i, case in enumerate(cases):
        run_case(pool, case, f"_{i}" if args.cases else "")


def run_case(pool, case, suffix=""):
    kwargs = dict(model_path=case["model"], engine={"precision": case["precision"], "tensor_parallel": case["tp"],
                                                    "pipeline_parallel": case["pp"], "micro_batch_size": 2},
                  optim={"lr": 1e-3, "adam_eps": 1e-4}, ppo={"ppo_mini_batch_size": 4})
    actor = WorkerGroup(pool, Actor, role=f"actor{suffix}", kwargs=kwargs)
    twin = WorkerGroup(pool, Actor, role=f"twin{suffix}", kwargs=kwargs)
    result = {"first": [actor.update_actor(batch_for(0)), twin.update_actor(batch_for(0))]}
    actor.save_hf(os.path.join(case["out"], "trained"))
    for method in ("micro_dp", "full_allgather", "tp_pp_gather"):
        stats = actor.to_generation(case["gen_tp"], case["gen_pp"], method, release_training=method == "micro_dp")
        result[method] = {"stats": stats, "weights": actor.generation_weights()}
    result["back"] = actor.to_training()
    result["second"] = [actor.update_actor(batch_for(1)), twin.update_actor(batch_for(1))]
    torch.save(result, os.path.join(case["out"], "hybrid.pt"))


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
