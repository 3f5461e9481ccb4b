"""Bad model configs and model/layout pairs fail before any process group forms."""

import json

import pytest

from hybridengine.model.spec import ModelConfigError, ModelSpec

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128, "intermediate_size": 384,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 512, "tie_word_embeddings": False, "hidden_act": "silu",
}


def test_reads_llama_and_qwen2_configs():
    spec = ModelSpec.from_hf_config(LLAMA)
    assert (spec.num_query_groups, spec.head_dim, spec.rope_theta, spec.qkv_bias) == (2, 32, 500000.0, False)
    qwen = ModelSpec.from_hf_config({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True})
    assert qwen.qkv_bias and qwen.tie_word_embeddings
    critic = ModelSpec.from_hf_config({**LLAMA, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1})
    assert critic.is_value_model and critic.num_labels == 1


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ModelConfigError, match=r"architecture \['GPT2LMHeadModel'\] is not supported; supported: \["):
        ModelSpec.from_hf_config({**LLAMA, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu' is not supported"):
        ModelSpec.from_hf_config({**LLAMA, "hidden_act": "gelu"})


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json in"):
        ModelSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="is not valid JSON"):
        ModelSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert ModelSpec.from_pretrained(tmp_path).num_layers == 4


@pytest.mark.parametrize(
    "overrides,tp,pp,message",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 192}, 4, 1, "does not divide the attention heads 6"),
        ({}, 4, 1, r"does not divide the key/value heads \(query groups\) 2"),
        ({"intermediate_size": 300, "num_key_value_heads": 4}, 8, 1, "does not divide the attention heads 4"),
        ({"intermediate_size": 301}, 2, 1, "does not divide the FFN hidden size 301"),
        ({"vocab_size": 255}, 2, 1, "does not divide the vocab size 255 .*not padded"),
        ({}, 1, 3, r"pipeline_parallel 3 does not divide the 4 layers; valid PP sizes: \[1, 2, 4\]"),
    ],
)
def test_layouts_that_do_not_fit_the_model(overrides, tp, pp, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelSpec.from_hf_config({**LLAMA, **overrides}).check_layout(tp, pp)


def test_error_lists_the_tp_sizes_that_would_work():
    with pytest.raises(ModelConfigError, match=r"TP sizes that divide every split dimension of this model: \[1, 2\]"):
        ModelSpec.from_hf_config(LLAMA).check_layout(4, 1)


def test_rope_theta_as_transformers_5_writes_it(tmp_path):
    """transformers 5 saves RoPE as rope_parameters; a theta other than the default must reach the spec."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, rope_theta=100000.0,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    assert ModelSpec.from_pretrained(tmp_path).rope_theta == 100000.0
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="rope_type 'llama3'"):
        ModelSpec.from_pretrained(tmp_path)
