"""Run under torchrun: PPO updates with checkpoint save / resume, results to a file.

    resume_program.py MODEL ROOT OUT --tp T --pp P --phase full|resume [--dist-opt] [--precision P] [--mini-batch M]
                      [--ep E] [--also-ep E2] [--also-precision P2 --also-root ROOT2 --also-out OUT2]
full:   updates on batches 0, 1, 2; checkpoint after update 0; HF export after update 0 and at the end.
resume: load ROOT's latest checkpoint; HF export; checkpoint again (OUT/resaved); updates on batches 1, 2;
        HF export at the end.
Each update is ppo_epochs=2 x (8 / M) optimizer steps. DP = WORLD_SIZE / (T x P). ``--also-precision``: a
second case at another precision (same layout and optimizer), a group of its own on the same processes, run
after the first into ROOT2 / OUT2 (one launch where there would be two).
"""

import argparse
import os

import torch

from controller import ResourcePool, WorkerGroup
from tiny_models import make_rl_batch
from workers import DataProto
from workers.actor import Actor
from controller.runtime.process_exit import exit_process


def batch_for(update: int) -> DataProto:
    batch = make_rl_batch(seed=10 + update)
    g = torch.Generator().manual_seed(20 + update)
    mask = batch.batch["response_mask"]
    shape = mask.shape
    train = DataProto({
        "old_log_probs": (-3.0 + 0.5 * torch.randn(shape, generator=g)) * mask,
        "advantages": torch.randn(shape, generator=g) * mask,
    })
    return batch.union(train)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--phase", choices=["full", "resume"])
    parser.add_argument("--dist-opt", action="store_true")
    parser.add_argument("--precision")  # omitted: the engine's default
    parser.add_argument("--mini-batch", type=int, default=4)
    parser.add_argument("--ep", type=int, default=1, help="expert_parallel (a mixture of experts)")
    parser.add_argument("--also-ep", type=int, default=None,
                        help="resume: also load the checkpoint at this EP in the same processes, to OUT/ep{N}")
    parser.add_argument("--also-precision", help="a second case at this precision, after the first")
    parser.add_argument("--also-root")
    parser.add_argument("--also-out")
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])

    def actor_at(ep: int, role: str, precision: str | None) -> WorkerGroup:
        return WorkerGroup(pool, Actor, role=role, kwargs=dict(
            model_path=args.model,
            engine={"tensor_parallel": args.tp, "pipeline_parallel": args.pp, "micro_batch_size": 2,
                    **({"expert_parallel": ep} if ep > 1 else {}),
                    **({"precision": precision} if precision else {})},
            optim={"lr": 1e-3, "adam_eps": 1e-4, "lr_warmup_steps": 2, "lr_decay_steps": 10,
                   "lr_decay_style": "cosine", "use_distributed_optimizer": args.dist_opt},
            ppo={"ppo_mini_batch_size": args.mini_batch, "ppo_epochs": 2, "shuffle": True},
        ))

    cases = [(actor_at(args.ep, "actor", args.precision), args.root, args.out)]
    if args.also_precision:
        cases.append((actor_at(args.ep, "actor_also", args.also_precision), args.also_root, args.also_out))
    if args.phase == "resume" and args.also_ep:  # another expert split, loaded before anything trains on
        other, where = actor_at(args.also_ep, "actor_other", args.precision), os.path.join(args.out, f"ep{args.also_ep}")
        other.load_checkpoint(args.root)
        other.save_hf(os.path.join(where, "weights_loaded"))
        other.save_checkpoint(os.path.join(where, "resaved"), 1)
    for actor, root, out in cases:
        run_phase(actor, root, out, args.phase)


def run_phase(actor: WorkerGroup, root: str, out: str, phase: str) -> None:
    metrics = []
    if phase == "full":
        for update in range(3):
            metrics.append(actor.update_actor(batch_for(update))[0])
            if update == 0:
                actor.save_checkpoint(root, 1)
                actor.save_hf(os.path.join(out, "weights_after_0"))
    else:
        extra = actor.load_checkpoint(root)[0]
        assert extra["step"] == 1 and extra["update_count"] == 1, extra
        actor.save_hf(os.path.join(out, "weights_loaded"))
        actor.save_checkpoint(os.path.join(out, "resaved"), 1)  # what was loaded, written at this layout
        for update in (1, 2):
            metrics.append(actor.update_actor(batch_for(update))[0])
    actor.save_hf(os.path.join(out, "weights_final"))
    torch.save(metrics, os.path.join(out, f"metrics_{phase}.pt"))


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
