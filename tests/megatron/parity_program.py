"""Run under torchrun: the Actor (and Critic) on a TP/PP/DP layout, results to a file.

    torchrun --nproc-per-node N parity_program.py MODEL_DIR OUT_DIR --tp T --pp P [--agg MODE]
    torchrun --nproc-per-node N parity_program.py --cases CASES.json [--role export]   (several runs, one launch)

CASES.json: a list of {model, out, tp, pp, agg, dist_opt, logits_output, precision; optional freeze_vision_tower,
checkpoint, token_budget, cp (context_parallel), pack (pack_sequences), teacher} (an export's: model, out, tp,
pp, precision), each run in turn with worker groups of its own on the same processes.

``teacher``: a Teacher on the same model gives its log-probs, and the step's KL term is the teacher's
(``teacher_kl_coef``, the inputs' reference log-probs given as the teacher's) instead of ``ppo.use_kl_loss``'s.
"""

import argparse
import json
import os
from pathlib import Path

import torch

from controller import ResourcePool, WorkerGroup
from hybridengine.model.spec import ModelSpec
from workers.actor import Actor, PolicyUpdateTerms, PPOActorConfig, ReferencePolicy
from workers import DataProto
from workers.critic import Critic
from workers.teacher import Teacher
from controller.runtime.process_exit import exit_process


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--cases", help="a JSON list of actor runs (see above), instead of MODEL_DIR OUT_DIR")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--agg", default="token-mean")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--role", default="actor", choices=["actor", "critic", "export"])
    parser.add_argument("--lora", help="critic: then a LoRA critic's step, its adapters from this PEFT directory")
    parser.add_argument("--context-parallel", type=int, default=1,
                        help="critic: then the same step with each sequence over this many CP ranks, packed")
    parser.add_argument("--dist-opt", action="store_true", help="megatron's distributed optimizer")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--logits-output", action="store_true",
                        help="the actor keeps megatron's output layer (fused_output_layer: false)")
    args = parser.parse_args()
    out = Path(args.out) if args.out else None

    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    if args.role == "export":
        cases = json.loads(Path(args.cases).read_text()) if args.cases else [
            {"model": args.model, "out": args.out, "tp": args.tp, "pp": args.pp, "precision": args.precision}]
        for i, case in enumerate(cases):
            export(pool, case, f"_{i}" if args.cases else "")
        return
    if args.cases:
        for i, case in enumerate(json.loads(Path(args.cases).read_text())):
            run_actor(pool, case, args.temperature, f"_{i}")
        return
    inputs = torch.load(out / "inputs.pt", weights_only=False)
    if args.role == "critic":
        return run_critic(args, pool, inputs, out)
    run_actor(pool, {"model": args.model, "out": args.out, "tp": args.tp, "pp": args.pp, "agg": args.agg,
                     "dist_opt": args.dist_opt, "logits_output": args.logits_output, "precision": args.precision},
              args.temperature)


def export(pool, case, suffix=""):
    """Import case["model"] at its layout and export it again, to case["out"]/exported."""
    # A value-head checkpoint goes through the critic, a causal LM through the reference policy.
    role = Critic if ModelSpec.from_pretrained(case["model"]).is_value_model else ReferencePolicy
    group = WorkerGroup(pool, role, role=f"export{suffix}", kwargs=dict(model_path=case["model"], engine={
        "precision": case["precision"], "tensor_parallel": case["tp"], "pipeline_parallel": case["pp"]}))
    group.save_hf(str(Path(case["out"]) / "exported"))


def run_actor(pool, case, temperature, suffix=""):
    """One actor run: log-probs, the reference's, a PPO step, the export and the engines' sizes, to case["out"]."""
    out = Path(case["out"])
    inputs = torch.load(out / "inputs.pt", weights_only=False)
    layout = {"precision": case["precision"], "tensor_parallel": case["tp"], "pipeline_parallel": case["pp"],
              "context_parallel": case.get("cp", 1), "pack_sequences": case.get("pack", False)}
    teacher = case.get("teacher", False)
    ppo = PPOActorConfig(ppo_mini_batch_size=8, shuffle=False, entropy_coeff=0.01, use_kl_loss=not teacher,
                         kl_loss_coef=0.1, kl_loss_type="k3", loss_agg_mode=case["agg"])
    actor = WorkerGroup(
        pool, Actor, role=f"actor{suffix}",
        kwargs=dict(
            model_path=case["model"],
            engine={**layout, "micro_batch_size": 2, "fused_output_layer": not case["logits_output"],
                    **({"max_tokens_per_micro_batch": case["token_budget"]} if case.get("token_budget") else {})},
            freeze_vision_tower=case.get("freeze_vision_tower", True),
            optim={"lr": 1e-3, "clip_grad": 1.0, "adam_eps": 1e-4, "use_distributed_optimizer": case["dist_opt"]},
            ppo=ppo,
        ),
    )
    ref = WorkerGroup(pool, ReferencePolicy, role=f"ref{suffix}", kwargs=dict(
        model_path=case["model"], engine={**layout, "micro_batch_size": 4}))
    batch = inputs["batch"]
    batch.meta_info["temperature"] = temperature
    packed = case.get("cp", 1) > 1 or case.get("pack", False)
    log_probs = actor.compute_log_prob(batch)
    ref_log_probs = ref.compute_ref_log_prob(batch)
    train, terms, teacher_log_probs = inputs["train"], None, None
    if teacher:  # the KL term's log-probs given as the teacher's, the teacher's own from a Teacher worker
        teacher_log_probs = WorkerGroup(pool, Teacher, role=f"teacher{suffix}", kwargs=dict(
            model_path=case["model"], engine={**layout, "micro_batch_size": 4})).compute_teacher_log_prob(batch)
        train = DataProto({**{k: v for k, v in train.batch.items() if k != "ref_log_prob"},
                           "teacher_log_probs": train.batch["ref_log_prob"]})
        terms = PolicyUpdateTerms(ppo.policy_loss_spec(), teacher_kl_coef=ppo.kl_loss_coef)
    metrics = actor.update_actor(batch.union(train), terms)
    actor.save_hf(str(out / "after_step"))
    restored = None
    if case.get("checkpoint"):  # the stepped actor through a checkpoint into a fresh one: its log-probs
        actor.save_checkpoint(str(out / "checkpoints"), 1)
        fresh = WorkerGroup(pool, Actor, role=f"restored{suffix}", kwargs=dict(
            model_path=case["model"], engine={**layout, "micro_batch_size": 2},
            freeze_vision_tower=case.get("freeze_vision_tower", True)))
        fresh.load_checkpoint(str(out / "checkpoints"))
        restored = fresh.compute_log_prob(batch)
    torch.save({"log_probs": log_probs, "restored_log_probs": restored, "ref_log_probs": ref_log_probs,
                "teacher_log_probs": teacher_log_probs, "metrics": metrics, "layout": str(actor.layout),
                "state_bytes": actor.state_bytes(), "ref_state_bytes": ref.state_bytes(),
                # packed rows and CP: rows of one length (the activation model's shape is rows x the longest row)
                "activations": (actor.saved_activation_bytes(DataProto.concat([batch[:1]] * 4) if packed else batch)
                                if case["pp"] == 1 else None)}, out / "result.pt")


def run_critic(args, pool, inputs, out):
    critic = WorkerGroup(
        pool, Critic, role="critic",
        kwargs=dict(
            model_path=args.model,
            engine={"precision": args.precision, "tensor_parallel": args.tp, "pipeline_parallel": args.pp, "micro_batch_size": 2},
            optim={"lr": 1e-3, "clip_grad": 1.0, "adam_eps": 1e-4},
            critic={"ppo_mini_batch_size": 8, "shuffle": False, "clip_range_value": 0.2, "loss_agg_mode": args.agg},
        ),
    )
    batch = inputs["batch"]
    values = critic.compute_values(batch)
    metrics = critic.update_critic(batch.union(inputs["train"]))
    critic.save_hf(str(out / "after_step"))
    torch.save({"values": values, "metrics": metrics, "layout": str(critic.layout), "state_bytes": critic.state_bytes()},
               out / "result.pt")
    if args.lora:  # the same on LoRA adapters over the frozen base, the value head trained beside them
        lora = WorkerGroup(pool, Critic, role="lora_critic", kwargs=dict(
            model_path=args.model,
            engine={"precision": args.precision, "tensor_parallel": args.tp, "pipeline_parallel": args.pp,
                    "micro_batch_size": 2},
            optim={"lr": 1e-3, "clip_grad": 1.0, "adam_eps": 1e-4},
            critic={"ppo_mini_batch_size": 8, "shuffle": False, "clip_range_value": 0.2, "loss_agg_mode": args.agg},
            lora={"rank": 4, "alpha": 8.0, "adapter_path": args.lora}))
        values = lora.compute_values(batch)
        metrics = lora.update_critic(batch.union(inputs["train"]))
        lora.save_hf(str(out / "lora_merged"))
        lora.save_peft(str(out / "lora_adapter"))
        torch.save({"values": values, "metrics": metrics, "state_bytes": lora.state_bytes()}, out / "lora_result.pt")
    if args.context_parallel > 1:  # the same critic step, each sequence split over the CP ranks, rows packed
        split = WorkerGroup(pool, Critic, role="cp_critic", kwargs=dict(
            model_path=args.model,
            engine={"precision": args.precision, "tensor_parallel": args.tp, "pipeline_parallel": args.pp,
                    "micro_batch_size": 2, "context_parallel": args.context_parallel, "pack_sequences": True},
            optim={"lr": 1e-3, "clip_grad": 1.0, "adam_eps": 1e-4},
            critic={"ppo_mini_batch_size": 8, "shuffle": False, "clip_range_value": 0.2, "loss_agg_mode": args.agg}))
        values = split.compute_values(batch)
        metrics = split.update_critic(batch.union(inputs["train"]))
        split.save_hf(str(out / "cp_after_step"))
        torch.save({"values": values, "metrics": metrics, "layout": str(split.layout)}, out / "cp_result.pt")


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
