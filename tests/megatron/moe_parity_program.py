"""Run under torchrun: the actor and reference policy of a mixture of experts at several layouts, one launch.

    torchrun --nproc-per-node 4 moe_parity_program.py OUT_DIR

OUT_DIR/cases.json lists the cases, each {"model", "tp", "pp", "ep", "etp", "dist_opt", "logits_output", "export",
"reshard": [[generation TP, PP, whole experts], ...]}; case i
reads OUT_DIR/inputs_{i}.pt (batch and training tensors; a batch with routed_experts replays them, and its
log-probs are computed a second time with the same routes only compared, as rollout_routed_experts) and writes
OUT_DIR/result_{i}.pt, its weights after one step to OUT_DIR/after_step_{i} and, with "export", the reference
policy's (untrained) weights to OUT_DIR/exported_{i}; with "reshard", the actor's generation weights at each
generation layout (resharded, then back to training, before the step). Every case is a pair of worker groups of its own on the
same processes (two grids per process), so one start-up serves them all.
"""

import argparse
import json
import os
from pathlib import Path

import torch

from controller import ResourcePool, WorkerGroup
from controller.runtime.process_exit import exit_process
from workers.actor import Actor, ReferencePolicy


def run_case(pool, out: Path, i: int, case: dict) -> None:
    model = case["model"]
    experts = {"expert_parallel": case["ep"], "expert_tensor_parallel": case.get("etp")}
    layout = {"precision": "fp32", "tensor_parallel": case["tp"], "pipeline_parallel": case["pp"], **experts}
    dp = pool.world_size // (case["tp"] * case["pp"])
    actor = WorkerGroup(pool, Actor, role=f"actor{i}", kwargs=dict(
        model_path=model,
        engine={**layout, "micro_batch_size": 2, "fused_output_layer": not case.get("logits_output", False)},
        optim={"lr": 1e-3, "clip_grad": 1.0, "adam_eps": 1e-4, "use_distributed_optimizer": case.get("dist_opt", False)},
        ppo={"ppo_mini_batch_size": 8, "shuffle": False, "entropy_coeff": 0.01, "use_kl_loss": True,
             "kl_loss_coef": 0.1, "kl_loss_type": "k3", "loss_agg_mode": "token-mean"},
    ))
    ref = WorkerGroup(pool, ReferencePolicy, role=f"ref{i}", kwargs=dict(
        model_path=model, engine={**layout, "micro_batch_size": 4 if dp <= 2 else 2}))
    inputs = torch.load(out / f"inputs_{i}.pt", weights_only=False)
    batch = inputs["batch"]
    batch.meta_info["temperature"] = inputs["temperature"]
    if case.get("export"):
        ref.save_hf(str(out / f"exported_{i}"))
    reshards = []  # before the step: the weights are the checkpoint's; the step after checks training is intact
    for tensor_parallel, pipeline_parallel, whole in case.get("reshard", []):
        stats = actor.to_generation(tensor_parallel, pipeline_parallel, expert_parallel=whole)
        reshards.append({"stats": stats, "weights": actor.generation_weights()})
        actor.to_training()
    # What one micro-batch's forward keeps for backward, against the planner's MoE activation formula (PP 1).
    activations = actor.saved_activation_bytes(batch) if case["pp"] == 1 else None
    log_probs = actor.compute_log_prob(batch)
    measured = None
    if "routed_experts" in batch.batch:  # the same routes as the rollout's, only compared (router_replay: measure)
        tensors = {("rollout_routed_experts" if k == "routed_experts" else k): v for k, v in batch.batch.items()}
        measured = actor.compute_log_prob(type(batch)(tensors, batch.non_tensor_batch, batch.meta_info))
    ref_log_probs = ref.compute_ref_log_prob(batch)
    metrics = actor.update_actor(batch.union(inputs["train"]))
    actor.save_hf(str(out / f"after_step_{i}"))
    torch.save({"log_probs": log_probs, "measured": measured, "ref_log_probs": ref_log_probs, "metrics": metrics,
                "activations": activations,
                "layout": str(actor.layout),
                "state_bytes": actor.state_bytes(), "ref_state_bytes": ref.state_bytes(), "reshards": reshards},
               out / f"result_{i}.pt")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    out = Path(args.out)
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    for i, case in enumerate(json.loads((out / "cases.json").read_text())):
        run_case(pool, out, i, case)


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
