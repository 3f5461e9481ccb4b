"""Run under torchrun: an actor and a rollout colocated on every rank; generate, check, update, generate again.

Writes what the test compares against HF transformers to OUT/rollout.pt.
"""

import argparse
import os

import torch

from controller import ResourcePool, WorkerGroup
from workers import DataProto
from workers.actor import Actor
from workers.rollout import Rollout
from controller.runtime.process_exit import exit_process

PROMPTS = [[5, 9, 33, 7], [100, 4, 3], [44, 45, 46, 47, 48, 49], [7], [200, 201, 13, 14, 90], [66, 67]]


def prompt_batch(prompts=PROMPTS, width=8, **sampling) -> DataProto:
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return DataProto({"input_ids": ids, "attention_mask": mask}, {"row": list(range(len(prompts)))},
                     {"sampling": sampling})


def bad_inputs(rollout) -> dict[str, str]:
    """Each bad request must fail before generation, with a message; the group must stay usable."""
    errors = {}
    cases = {
        "too_long": prompt_batch(PROMPTS[:3] + [list(range(3, 13))], width=10, greedy=True),
        "max_new_tokens": prompt_batch(max_new_tokens=0),
        "empty": DataProto({"input_ids": torch.zeros(0, 4, dtype=torch.long), "attention_mask": torch.zeros(0, 4, dtype=torch.long)}),
    }
    for name, batch in cases.items():
        try:
            rollout.generate_sequences(batch)
            errors[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            errors[name] = f"{type(exc).__name__}: {exc}"
    errors["after"] = rollout.generate_sequences(prompt_batch(greedy=True))
    return errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--gen-tp", type=int, default=1)
    parser.add_argument("--gen-pp", type=int, default=1)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--ep", type=int, default=1, help="the actor's expert parallelism (a mixture of experts)")
    parser.add_argument("--etp", type=int, default=None, help="the actor's expert tensor parallelism (None: as TP)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--expert-parallel", action="store_true", help="generation: whole experts per TP rank")
    parser.add_argument("--return-routed-experts", action="store_true", help="the rollout reports its routes")
    parser.add_argument("--weight-bucket-bytes", type=int, default=256 << 20, help="the rollout's weight_bucket_bytes")
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    actor = WorkerGroup(pool, Actor, role="actor", kwargs=dict(
        model_path=args.model, engine={"precision": args.precision, "tensor_parallel": args.tp, "pipeline_parallel": args.pp,
                                       "micro_batch_size": args.micro_batch,
                                       **({"expert_parallel": args.ep, "expert_tensor_parallel": args.etp}
                                          if args.ep > 1 else {})},
        optim={"lr": 2e-2, "adam_eps": 1e-4}, ppo={"ppo_mini_batch_size": 12}))
    rollout = WorkerGroup(pool, Rollout, role="rollout", kwargs=dict(model_path=args.model, config={
        "engine": args.engine, "tensor_parallel": args.gen_tp, "pipeline_parallel": args.gen_pp,
        "expert_parallel": args.expert_parallel, "return_routed_experts": args.return_routed_experts,
        "max_prompt_length": 8, "sampling": {"max_new_tokens": 10}, "weight_bucket_bytes": args.weight_bucket_bytes}))
    result = {"greedy": rollout.generate_sequences(prompt_batch(greedy=True))}
    sampled = rollout.generate_sequences(prompt_batch(temperature=0.7, seed=123, n=2))
    result["sampled"] = sampled
    result["sampled_again"] = rollout.generate_sequences(prompt_batch(temperature=0.7, seed=123, n=2))
    # The same prompts in reverse order: with per-request seeds a prompt's samples follow its index, so
    # the reversed batch's prompt k gets the seeds of index k, not of its old position.
    result["other_seed"] = rollout.generate_sequences(prompt_batch(temperature=0.7, seed=7, n=2))
    recomputed = actor.compute_log_prob(sampled)
    result["recomputed"] = recomputed
    # One PPO step on the sampled batch with made-up advantages moves the weights; the next rollout must follow.
    update = sampled.union(recomputed)
    update.batch["advantages"] = torch.linspace(-1, 1, len(update)).unsqueeze(1).expand_as(update.batch["responses"]).contiguous()
    result["update"] = actor.update_actor(update)
    actor.save_hf(os.path.join(args.out, "updated"))
    result["greedy_after"] = rollout.generate_sequences(prompt_batch(greedy=True))
    result["errors"] = bad_inputs(rollout)
    torch.save(result, os.path.join(args.out, "rollout.pt"))


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
