"""Run under torchrun (4 ranks): model families on megatron at TP2 x PP2, and vLLM after a sync.

    torchrun --nproc-per-node 4 family_program.py OUT_DIR NAME=MODEL_DIR:VOCAB[:PAD] ...

In one launch, for each family in turn: full logits and (unfused) log-probs from a reference policy
that keeps megatron's output layer; the actor's fused log-probs and
entropies; the actor exported as a HF checkpoint; greedy responses from a
vLLM rollout (generation TP2, weights synced from the actor) and from the
megatron rollout (TP2 x PP2). Everything goes to OUT_DIR/family.pt for the
test to hold against HF transformers
(OUT_DIR/NAME/family.pt for each).
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from rollout_program import prompt_batch

from controller import ResourcePool, WorkerGroup
from workers import DataProto, Dispatch, register
from workers.actor import Actor, ReferencePolicy
from workers.megatron.token_outputs import response_log_probs
from workers.rollout import Rollout
from controller.runtime.process_exit import exit_process

PROMPT, RESPONSE = 7, 5


class LogitsProbe(ReferencePolicy):
    """A reference policy that also returns the full logits (gathered over TP) of every position."""

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def logits(self, data: DataProto) -> DataProto | None:
        engine = self.engine

        def step(mb, output):
            parts = [torch.empty_like(output) for _ in range(engine.layout.tp)]
            dist.all_gather(parts, output.contiguous(), group=engine.groups.tp_group)
            log_prob, entropy = response_log_probs(engine, mb, output, 1.0)
            return torch.zeros(()), {"logits": torch.cat(parts, -1), "log_probs": log_prob, "entropy": entropy}

        outputs = engine.run(data, step, forward_only=True)
        if not outputs:
            return None
        return DataProto({key: outputs.rows(key) for key in ("logits", "log_probs", "entropy")})


def token_batch(vocab: int, rows: int = 4) -> DataProto:
    """Unpadded rows (RoPE positions 0..S-1, as in a plain HF forward) of random ids of the real vocabulary."""
    ids = torch.randint(3, vocab, (rows, PROMPT + RESPONSE), generator=torch.Generator().manual_seed(5))
    ids[0, -1] = vocab - 1  # the last real id is a target too
    mask = torch.ones_like(ids)
    return DataProto({"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(ids.shape[1]).expand_as(ids),
                      "responses": ids[:, PROMPT:], "response_mask": mask[:, PROMPT:]})


def run_family(pool, name: str, model: str, vocab: int, pad: int | None, out: Path) -> dict:
    engine = {"precision": "fp32", "tensor_parallel": 2, "pipeline_parallel": 2, "micro_batch_size": 2,
              "make_vocab_size_divisible_by": pad}
    actor = WorkerGroup(pool, Actor, role=f"{name}_actor", kwargs=dict(
        model_path=model, engine=engine, optim={"lr": 1e-3}, ppo={"ppo_mini_batch_size": 4}))
    probe = WorkerGroup(pool, LogitsProbe, role=f"{name}_probe", kwargs=dict(
        model_path=model, engine={**engine, "fused_output_layer": False}))
    batch = token_batch(vocab)
    result = {"batch": batch, "probe": probe.logits(batch), "actor": actor.compute_log_prob(batch)}
    actor.save_hf(str(out / "exported"))
    sampling = {"max_new_tokens": 10}
    vllm = WorkerGroup(pool, Rollout, role=f"{name}_rollout", kwargs=dict(model_path=model, actor_role=f"{name}_actor", config={
        "engine": "vllm", "tensor_parallel": 2, "max_prompt_length": 8, "sampling": sampling}))
    result["vllm_greedy"] = vllm.generate_sequences(prompt_batch(greedy=True))
    megatron = WorkerGroup(pool, Rollout, role=f"{name}_megatron_rollout", kwargs=dict(model_path=model, actor_role=f"{name}_actor", config={
        "engine": "megatron", "tensor_parallel": 2, "pipeline_parallel": 2, "max_prompt_length": 8,
        "sampling": sampling}))
    result["megatron_greedy"] = megatron.generate_sequences(prompt_batch(greedy=True))
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("families", nargs="+", help="NAME=MODEL_DIR:VOCAB[:PAD], PAD being make_vocab_size_divisible_by")
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    for family in args.families:
        name, spec = family.split("=", 1)
        model, vocab, *pad = spec.split(":")
        out = Path(args.out) / name
        result = run_family(pool, name, model, int(vocab), int(pad[0]) if pad else None, out)
        torch.save(result, out / "family.pt")


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
