"""Generation shards in vLLM's per-rank layout, checked against HF tensors split the way vLLM splits them."""

import pytest
import torch

from hybridengine.model.hf_mapping import cut_shard, hf_source
from hybridengine.model.catalogue import stage_params
from hybridengine.model.vllm_layout import to_vllm_shard
from test_hf_mapping import SPEC, full_checkpoint


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_shard_is_q_k_v_and_gate_up_of_the_rank(tp):
    tensors = full_checkpoint(SPEC)
    read = lambda name, index: tensors[name][index] if index else tensors[name]  # noqa: E731
    for rank in range(tp):
        weights = {p.name: cut_shard(hf_source(p.name, SPEC, 0, 1), read, SPEC, rank, tp) for p in stage_params(SPEC, tp, 1, 0)}
        vllm = to_vllm_shard(SPEC, weights, tp, 1, 0)
        for layer in range(SPEC.num_layers):
            p = f"model.layers.{layer}."
            q = tensors[p + "self_attn.q_proj.weight"].chunk(tp)[rank]  # vLLM: each rank its heads' rows
            k = tensors[p + "self_attn.k_proj.weight"].chunk(tp)[rank]
            v = tensors[p + "self_attn.v_proj.weight"].chunk(tp)[rank]
            assert torch.equal(vllm[p + "self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
            qb, kb, vb = (tensors[p + f"self_attn.{n}_proj.bias"].chunk(tp)[rank] for n in "qkv")
            assert torch.equal(vllm[p + "self_attn.qkv_proj.bias"], torch.cat([qb, kb, vb]))
            gate = tensors[p + "mlp.gate_proj.weight"].chunk(tp)[rank]
            up = tensors[p + "mlp.up_proj.weight"].chunk(tp)[rank]
            assert torch.equal(vllm[p + "mlp.gate_up_proj.weight"], torch.cat([gate, up]))
            assert torch.equal(vllm[p + "self_attn.o_proj.weight"], tensors[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[rank])
        assert torch.equal(vllm["lm_head.weight"], tensors["lm_head.weight"].chunk(tp)[rank])
        assert torch.equal(vllm["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"].chunk(tp)[rank])


@pytest.mark.parametrize("whole", [False, True], ids=["experts-cut", "expert-parallel"])
def test_routed_experts_stack_as_vllm_holds_them_in_either_generation_split(whole):
    """vLLM's fused-experts tensors from a generation shard at TP2: w13 [experts, 2 x FFN, hidden] ([gate; up])
    and w2 [experts, hidden, FFN], in the rank's expert order: every expert cut to half its FFN, or (vLLM's
    expert parallelism) half of the experts whole."""
    from hybridengine.model.catalogue import ExpertShard
    from hybridengine.model.spec import ModelSpec
    from test_moe_layout import QWEN3_MOE

    spec = ModelSpec.from_hf_config(QWEN3_MOE)  # 8 experts, expert FFN 32, hidden 64
    experts, ffn = spec.moe.num_experts, spec.moe.expert_ffn_hidden_size
    for rank in range(2):
        shard = ExpertShard(2, rank, 1) if whole else ExpertShard(1, 0, 2)
        weights = {p.name: torch.randn(p.shape) for p in stage_params(spec, 2, 1, 0, experts=shard)}
        vllm = to_vllm_shard(spec, weights, 2, 1, 0, rank, expert_parallel=whole)
        local, width = (experts // 2, ffn) if whole else (experts, ffn // 2)
        for layer in range(spec.num_layers):
            w13 = vllm[f"model.layers.{layer}.mlp.experts.w13_weight"]
            w2 = vllm[f"model.layers.{layer}.mlp.experts.w2_weight"]
            assert w13.shape == (local, 2 * width, spec.hidden_size) and w2.shape == (local, spec.hidden_size, width)
            for j in range(local):
                prefix = f"decoder.layers.{layer}.mlp.experts.local_experts.{j}"
                assert torch.equal(w13[j], weights[f"{prefix}.linear_fc1.weight"])
                assert torch.equal(w2[j], weights[f"{prefix}.linear_fc2.weight"])
        assert not any(".local_experts." in name for name in vllm)
