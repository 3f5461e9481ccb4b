"""Run under torchrun (1 rank): a vLLM rollout without an actor, serving the checkpoint as it is.

Stops: the EOS id is set to a token that greedy decoding produces, and a
stop string is the text of another. The shard loader refuses a shard that
lacks a fused group. Greedy partial rollouts (``generate_chunk``) continue where they stopped, and a
stop string that spans two of their calls ends the response. Writes
OUT/standalone.pt.
"""

import argparse
import os

import torch
from rollout_checks import hf_greedy
from rollout_program import PROMPTS, prompt_batch

from controller import ResourcePool, WorkerGroup
from workers import Dispatch, register
from workers.rollout import Rollout
from controller.runtime.process_exit import exit_process


class ProbeRollout(Rollout):
    @register(Dispatch.ONE_TO_ALL)
    def load_without_v(self) -> str:
        """Send a shard whose attention QKV is missing: must be refused, naming the parameter."""
        model = self.generator.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        shard = {name: torch.zeros(1) for name, _ in model.named_parameters() if "qkv_proj" not in name}
        try:
            self.generator.llm.collective_rpc("load_shard", args=(shard, None))
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            return f"{type(exc).__name__}: {exc}"
        return "no error"


def greedy_in_chunks(rollout, prompt: list[int], greedy: list[int]) -> list:
    """Async mode's partial rollouts: two rows of one prompt, the second 4 greedy tokens ahead, continued 4
    tokens a call (the last call mixes the limits 4 and 2); each call's output."""
    from workers.data_proto import DataProto

    responses = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    responses[1, :4], mask[1, :4] = torch.tensor(greedy[:4]), 1
    partial = DataProto({"prompts": torch.tensor([prompt, prompt]), "prompt_mask": torch.ones(2, len(prompt), dtype=torch.long),
                         "responses": responses, "response_mask": mask, "rollout_log_probs": torch.zeros(2, 10)},
                        meta_info={"sampling": {"greedy": True, "ignore_eos": True, "max_new_tokens": 4, "seed": None}})
    outputs = []
    for _ in range(2):
        out = rollout.generate_chunk(partial)
        outputs.append(out)
        partial = DataProto({**partial.batch, **{k: out.batch[k] for k in ("responses", "response_mask",
                                                                             "rollout_log_probs")}},
                            meta_info=partial.meta_info)
    return outputs


def stop_across_chunks(rollout, prompt: list[int], greedy: list[int], decode) -> dict | None:
    """A stop string that is two greedy tokens' text, the first ending one 4-token call and the second
    starting the next; the chunked calls' outputs and the one-call generation with the same stop."""
    from workers.data_proto import DataProto

    boundary = next((j for j in (4, 8) if decode(greedy[j - 1:j + 1]) not in decode(greedy[:j])), None)
    if boundary is None:
        return None
    stop = decode(greedy[boundary - 1:boundary + 1])
    partial = DataProto({"prompts": torch.tensor([prompt]), "prompt_mask": torch.ones(1, len(prompt), dtype=torch.long),
                         "responses": torch.zeros(1, 10, dtype=torch.long),
                         "response_mask": torch.zeros(1, 10, dtype=torch.long), "rollout_log_probs": torch.zeros(1, 10)},
                        meta_info={"sampling": {"greedy": True, "ignore_eos": True, "max_new_tokens": 4, "seed": None,
                                                "stop": [stop]}})
    chunks = []
    while not chunks or not chunks[-1].batch["finished"].all():
        chunks.append(rollout.generate_chunk(partial))
        partial = DataProto({**partial.batch, **{k: chunks[-1].batch[k] for k in ("responses", "response_mask",
                                                                                 "rollout_log_probs")}},
                            meta_info=partial.meta_info)
    whole = rollout.generate_sequences(prompt_batch(PROMPTS[:1], greedy=True, ignore_eos=True, stop=[stop]))
    return {"stop": stop, "boundary": boundary, "chunks": chunks, "whole": whole}


class RoutesRollout(Rollout):
    @register(Dispatch.ONE_TO_ALL)
    def routes_recomputed(self) -> int:
        """Forwards of the last generation that routed a preempted request's positions again."""
        return self.generator.routes_recomputed


PRESSURE = dict(prompts=3, prompt_tokens=100, new_tokens=60, cache_tokens=256)  # 160 tokens each; room for 256


def under_kv_pressure(pool, moe_model: str, out: dict) -> None:
    """A mixture of experts' rollout reporting its routes, with a KV cache of two of vLLM's CPU blocks (128 tokens
    each) for three requests of 160 tokens: each needs a second block at position 128, so vLLM preempts and
    recomputes. The routes filed are the recomputations'."""
    from hybridengine.model.spec import ModelSpec

    spec = ModelSpec.from_pretrained(moe_model)
    # K and V, fp32, per layer and KV head; vLLM's CPU cache takes twice what that gives (256 tokens, as its own
    # estimate of the longest sequence says when it is less)
    per_token = 2 * 2 * spec.num_layers * spec.num_query_groups * spec.head_dim * 4
    rollout = WorkerGroup(pool, RoutesRollout, role="moe_rollout", kwargs=dict(model_path=moe_model, actor_role=None, config={
        "engine": "vllm", "return_routed_experts": True, "max_prompt_length": PRESSURE["prompt_tokens"],
        "kv_cache_bytes": PRESSURE["cache_tokens"] * per_token, "max_num_seqs": PRESSURE["prompts"],
        "sampling": {"max_new_tokens": PRESSURE["new_tokens"]}}))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, spec.vocab_size, (PRESSURE["prompt_tokens"],), generator=g).tolist()
               for _ in range(PRESSURE["prompts"])]
    batch = prompt_batch(prompts, width=PRESSURE["prompt_tokens"], greedy=True, ignore_eos=True)
    out["pressured"] = rollout.generate_sequences(batch)
    out["pressured_recomputed"] = rollout.routes_recomputed()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--moe", action="store_true", help="MODEL is a mixture of experts: only its routes under "
                        "KV-cache pressure (one vLLM engine per process)")
    args = parser.parse_args()
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])])
    if args.moe:
        result = {}
        under_kv_pressure(pool, args.model, result)
        torch.save(result, os.path.join(args.out, "pressured.pt"))
        return
    greedy = hf_greedy(args.model, PROMPTS[0], 10)
    eos = greedy[2]  # greedy stops as soon as it produces this token
    rollout = WorkerGroup(pool, ProbeRollout, role="rollout", kwargs=dict(model_path=args.model, actor_role=None, config={
        "engine": "vllm", "max_prompt_length": 8, "eos_token_id": eos, "sampling": {"max_new_tokens": 10}}))
    result = {"hf_greedy": greedy, "eos": eos}
    result["greedy"] = rollout.generate_sequences(prompt_batch(PROMPTS[:1], greedy=True))
    result["no_eos"] = rollout.generate_sequences(prompt_batch(PROMPTS[:1], greedy=True, ignore_eos=True))
    from transformers import AutoTokenizer

    stop = AutoTokenizer.from_pretrained(args.model).decode([greedy[1]])
    result["stop"] = stop
    result["stopped"] = rollout.generate_sequences(prompt_batch(PROMPTS[:1], greedy=True, ignore_eos=True, stop=[stop]))
    result["short"] = rollout.generate_sequences(prompt_batch(PROMPTS[:1], greedy=True, ignore_eos=True, max_new_tokens=4))
    result["chunks"] = greedy_in_chunks(rollout, PROMPTS[0], greedy)
    result["stop_across"] = stop_across_chunks(rollout, PROMPTS[0], greedy, AutoTokenizer.from_pretrained(args.model).decode)
    result["missing_qkv"] = rollout.load_without_v()
    torch.save(result, os.path.join(args.out, "standalone.pt"))


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
