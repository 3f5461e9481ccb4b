"""HF <-> megatron parameter mapping, pure: no process group, no megatron model."""

import pytest
import torch

from hybridengine.model.hf_mapping import cut_shard, hf_source, merge_shards
from hybridengine.model.spec import ModelSpec

SPEC = ModelSpec(
    architecture="LlamaForCausalLM", vocab_size=16, hidden_size=8, ffn_hidden_size=12, num_layers=4,
    num_attention_heads=4, num_query_groups=2, head_dim=2, norm_epsilon=1e-6, rope_theta=1e4,
    max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=True,
)


def hf_tensors(spec, layer):
    g = torch.Generator().manual_seed(layer)
    p = f"model.layers.{layer}."
    qd, kvd = spec.num_attention_heads * spec.head_dim, spec.num_query_groups * spec.head_dim
    return {
        p + "self_attn.q_proj.weight": torch.randn(qd, spec.hidden_size, generator=g),
        p + "self_attn.k_proj.weight": torch.randn(kvd, spec.hidden_size, generator=g),
        p + "self_attn.v_proj.weight": torch.randn(kvd, spec.hidden_size, generator=g),
        p + "self_attn.q_proj.bias": torch.randn(qd, generator=g),
        p + "self_attn.k_proj.bias": torch.randn(kvd, generator=g),
        p + "self_attn.v_proj.bias": torch.randn(kvd, generator=g),
        p + "self_attn.o_proj.weight": torch.randn(spec.hidden_size, qd, generator=g),
        p + "mlp.gate_proj.weight": torch.randn(spec.ffn_hidden_size, spec.hidden_size, generator=g),
        p + "mlp.up_proj.weight": torch.randn(spec.ffn_hidden_size, spec.hidden_size, generator=g),
        p + "mlp.down_proj.weight": torch.randn(spec.hidden_size, spec.ffn_hidden_size, generator=g),
        p + "input_layernorm.weight": torch.randn(spec.hidden_size, generator=g),
        p + "post_attention_layernorm.weight": torch.randn(spec.hidden_size, generator=g),
    }


def full_checkpoint(spec):
    tensors = {"model.embed_tokens.weight": torch.randn(spec.vocab_size, spec.hidden_size),
               "lm_head.weight": torch.randn(spec.vocab_size, spec.hidden_size),
               "model.norm.weight": torch.randn(spec.hidden_size)}
    for layer in range(spec.num_layers):
        tensors.update(hf_tensors(spec, layer))
    return tensors


LOCAL_NAMES = [
    "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_cut_then_merge_reproduces_every_hf_tensor(tp, pp):
    tensors = full_checkpoint(SPEC)
    reads = []

    def read(name, index):
        reads.append((name, index))
        return tensors[name][index] if index else tensors[name]

    rebuilt = {}
    for pp_rank in range(pp):
        names = [f"decoder.layers.{j}.{n}" for j in range(SPEC.num_layers // pp) for n in LOCAL_NAMES]
        if pp_rank == 0:
            names.append("embedding.word_embeddings.weight")
        if pp_rank == pp - 1:
            names += ["decoder.final_layernorm.weight", "output_layer.weight"]
        for name in names:
            source = hf_source(name, SPEC, pp_rank, pp)
            shards = [cut_shard(source, read, SPEC, r, tp) for r in range(tp)]
            for shard in shards[1:]:
                assert shard.shape == shards[0].shape
            rebuilt.update(merge_shards(source, shards, SPEC))
    assert rebuilt.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(rebuilt[name], tensor), name


def test_qkv_is_group_major_and_tp_splits_along_groups():
    # 4 query heads in 2 groups, head_dim 1, hidden 1: rows are single numbers.
    spec = ModelSpec("LlamaForCausalLM", 4, 1, 2, 1, 4, 2, 1, 1e-6, 1e4, 8, False, False)
    q, k, v = torch.tensor([[0.0], [1], [2], [3]]), torch.tensor([[10.0], [11]]), torch.tensor([[20.0], [21]])
    tensors = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
               "model.layers.0.self_attn.v_proj.weight": v}
    source = hf_source("decoder.layers.0.self_attention.linear_qkv.weight", spec, 0, 1)
    read = lambda name, index: tensors[name][index] if index else tensors[name]  # noqa: E731
    assert cut_shard(source, read, spec, 0, 1).flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert cut_shard(source, read, spec, 1, 2).flatten().tolist() == [2, 3, 11, 21]


def test_fc1_shard_is_gate_chunk_then_up_chunk():
    tensors = full_checkpoint(SPEC)
    source = hf_source("decoder.layers.1.mlp.linear_fc1.weight", SPEC, 0, 1)
    read = lambda name, index: tensors[name][index] if index else tensors[name]  # noqa: E731
    gate, up = tensors["model.layers.1.mlp.gate_proj.weight"], tensors["model.layers.1.mlp.up_proj.weight"]
    for r in range(2):
        expected = torch.cat([gate.chunk(2)[r], up.chunk(2)[r]])
        assert torch.equal(cut_shard(source, read, SPEC, r, 2), expected)


def test_stage_local_layer_numbers_map_to_global_layers():
    assert hf_source("decoder.layers.0.mlp.linear_fc2.weight", SPEC, 1, 2).hf_names == ("model.layers.2.mlp.down_proj.weight",)
    assert hf_source("decoder.layers.0.input_layernorm.weight", SPEC, 3, 4).hf_names == ("model.layers.3.input_layernorm.weight",)


def test_tied_and_value_head_outputs():
    from dataclasses import replace

    tied = replace(SPEC, tie_word_embeddings=True)
    assert hf_source("output_layer.weight", tied, 0, 1).hf_names == ("model.embed_tokens.weight",)
    critic = replace(SPEC, architecture="LlamaForSequenceClassification", num_labels=1)
    source = hf_source("output_layer.weight", critic, 0, 1)
    assert source.hf_names == ("score.weight",) and source.kind == "replicated"
    with pytest.raises(KeyError, match="no Hugging Face source known for megatron parameter 'decoder.foo'"):
        hf_source("decoder.foo", SPEC, 0, 1)


def test_transformer_engine_fused_norm_names():
    assert hf_source("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", SPEC, 0, 1).hf_names == (
        "model.layers.1.input_layernorm.weight",)
    assert hf_source("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", SPEC, 1, 2).hf_names == (
        "model.layers.2.post_attention_layernorm.weight",)
