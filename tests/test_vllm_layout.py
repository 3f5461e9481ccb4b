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
