"""The parameter catalogue, pure: shard shapes, HF and vLLM names, stage layers, padded vocabularies."""

from dataclasses import replace

import pytest
import torch

from hybridengine.model.hf_mapping import cut_shard, hf_source, merge_shards
from hybridengine.model.spec import ModelConfigError, ModelSpec
from hybridengine.model.catalogue import ShardKind, lookup, stage_params
from hybridengine.model.vllm_layout import to_vllm_shard
from test_hf_mapping import full_checkpoint, hf_tensors

# Qwen3-like: head_dim 64 with hidden 128 and 4 heads (4 * 64 != 128), q/k norm, 301-token vocabulary.
QWEN3 = ModelSpec(
    architecture="Qwen3ForCausalLM", vocab_size=301, hidden_size=128, ffn_hidden_size=96, num_layers=4,
    num_attention_heads=4, num_query_groups=2, head_dim=64, norm_epsilon=1e-6, rope_theta=1e6,
    max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, qk_layernorm=True,
)


def qwen3_checkpoint(spec):
    tensors = full_checkpoint(replace(spec, qkv_bias=True))
    g = torch.Generator().manual_seed(7)
    for layer in range(spec.num_layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            del tensors[f"model.layers.{layer}.self_attn.{name}.bias"]
        for name in ("q_norm", "k_norm"):
            tensors[f"model.layers.{layer}.self_attn.{name}.weight"] = torch.randn(spec.head_dim, generator=g)
    return tensors


def test_qk_norm_entries_shapes_and_names():
    params = {p.name: p for p in stage_params(QWEN3, 2, 2, 1)}
    q_norm = params["decoder.layers.0.self_attention.q_layernorm.weight"]
    assert (q_norm.shape, q_norm.kind, q_norm.layer) == ((64,), ShardKind.REPLICATED, 2)
    assert q_norm.hf_names == ("model.layers.2.self_attn.q_norm.weight",)
    assert q_norm.vllm_name == "model.layers.2.self_attn.q_norm.weight"
    k_norm = params["decoder.layers.1.self_attention.k_layernorm.weight"]
    assert k_norm.hf_names == ("model.layers.3.self_attn.k_norm.weight",) and k_norm.shape == (64,)
    # QKV rows follow head_dim, not hidden / heads: (4 + 2 * 2) heads x 64 over TP2.
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (256, 128)
    assert params["decoder.layers.0.self_attention.linear_proj.weight"].shape == (128, 128)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in params
    assert params["output_layer.weight"].vllm_name == "lm_head.weight"
    # A model without q/k norm has no such entries.
    llama = replace(QWEN3, architecture="LlamaForCausalLM", qk_layernorm=False)
    assert not [p for p in stage_params(llama, 1, 1, 0) if "layernorm.weight" in p.name and "_attention" in p.name]


def test_kinds_compare_equal_to_their_old_strings():
    assert ShardKind.QKV == "qkv" and ShardKind.FC1 == "fc1" and ShardKind.VOCAB_ROWS == "vocab_rows"
    assert f"{ShardKind.COLUMNS}" == "columns"


def test_layers_of_stage_is_what_every_reader_uses():
    spec = replace(QWEN3, num_layers=6)
    for pp in (1, 2, 3, 6):
        covered = []
        for stage in range(pp):
            layers = spec.layers_of_stage(stage, pp)
            covered += list(layers)
            listed = sorted({p.layer for p in stage_params(spec, 1, pp, stage) if p.layer is not None})
            assert listed == list(layers)
            for local, layer in enumerate(layers):
                assert spec.stage_of_layer(layer, pp) == (stage, local)
                assert lookup(f"decoder.layers.{local}.mlp.linear_fc2.weight", spec, stage, pp).layer == layer
        assert covered == list(range(6))
    with pytest.raises(KeyError, match="stage 1 of 2 holds 3 layers"):
        lookup("decoder.layers.3.mlp.linear_fc2.weight", spec, 1, 2)


def test_padded_vocab_sizes_as_megatron_pads_them():
    assert QWEN3.vocab_rows == 301 and QWEN3.with_padded_vocab(None, 2) is QWEN3
    assert QWEN3.with_padded_vocab(128, 1).vocab_rows == 384
    assert QWEN3.with_padded_vocab(128, 2).vocab_rows == 512
    assert QWEN3.with_padded_vocab(1, 2).vocab_rows == 302
    padded = replace(QWEN3, num_query_groups=4).with_padded_vocab(128, 4)
    assert padded.vocab_size == 301 and padded.vocab_rows == 512
    padded.check_layout(4, 1)  # TP4 works on the padded vocabulary, though 301 is odd
    with pytest.raises(ModelConfigError, match="does not divide the vocab size 301 .*make_vocab_size_divisible_by"):
        QWEN3.check_layout(2, 1)
    params = {p.name: p for p in stage_params(padded, 4, 2, 0)}
    assert params["embedding.word_embeddings.weight"].shape == (128, 128)
    assert {p.name: p for p in stage_params(padded, 4, 2, 1)}["output_layer.weight"].shape == (128, 128)
    with pytest.raises(ModelConfigError, match="make_vocab_size_divisible_by must be a positive integer, got 0"):
        QWEN3.with_padded_vocab(0, 2)


@pytest.mark.parametrize("tp,pp", [(2, 2), (4, 1), (1, 2)])
def test_padded_rows_are_zero_on_import_and_stripped_on_export(tp, pp):
    spec = replace(QWEN3, num_query_groups=4).with_padded_vocab(128, tp)  # TP4: 512 rows, ranks 2 and 3 all padding
    tensors = qwen3_checkpoint(spec)
    read = lambda name, index: tensors[name][index] if index else tensors[name]  # noqa: E731
    rebuilt = {}
    for pp_rank in range(pp):
        for param in stage_params(spec, tp, pp, pp_rank):
            source = hf_source(param.name, spec, pp_rank, pp)
            shards = [cut_shard(source, read, spec, r, tp) for r in range(tp)]
            assert all(tuple(s.shape) == param.shape for s in shards), param.name
            if param.kind == ShardKind.VOCAB_ROWS:
                joined = torch.cat(shards)
                assert joined.shape[0] == spec.vocab_rows
                assert torch.equal(joined[: spec.vocab_size], tensors[param.hf_names[0]])
                assert torch.count_nonzero(joined[spec.vocab_size :]) == 0
            rebuilt.update(merge_shards(source, shards, spec))
    assert rebuilt.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(rebuilt[name], tensor), name


def test_vllm_shard_has_the_real_rows_and_qk_norms():
    spec = QWEN3.with_padded_vocab(128, 2)
    tensors = qwen3_checkpoint(spec)
    read = lambda name, index: tensors[name][index] if index else tensors[name]  # noqa: E731
    for rank, rows in ((0, slice(0, 256)), (1, slice(256, 301))):
        weights = {p.name: cut_shard(hf_source(p.name, spec, 0, 1), read, spec, rank, 2) for p in stage_params(spec, 2, 1, 0)}
        vllm = to_vllm_shard(spec, weights, 2, 1, 0, rank)
        assert torch.equal(vllm["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"][rows])
        assert torch.equal(vllm["lm_head.weight"], tensors["lm_head.weight"][rows])
        for layer in range(spec.num_layers):
            name = f"model.layers.{layer}.self_attn.k_norm.weight"
            assert torch.equal(vllm[name], tensors[name])
        q = tensors["model.layers.1.self_attn.q_proj.weight"].chunk(2)[rank]
        k = tensors["model.layers.1.self_attn.k_proj.weight"].chunk(2)[rank]
        v = tensors["model.layers.1.self_attn.v_proj.weight"].chunk(2)[rank]
        assert torch.equal(vllm["model.layers.1.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))


def test_hf_tensors_fixture_covers_the_catalogue():
    """Every HF name the catalogue lists for a plain Llama layer is a tensor the checkpoint has."""
    spec = replace(QWEN3, architecture="LlamaForCausalLM", qk_layernorm=False, qkv_bias=True, vocab_size=16)
    names = set(hf_tensors(spec, 0))
    listed = {n for p in stage_params(spec, 1, spec.num_layers, 0) if p.layer == 0 for n in p.hf_names}
    assert listed == names
