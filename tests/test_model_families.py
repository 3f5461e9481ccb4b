"""Model families read from config.json: Qwen3, Llama 3.x RoPE scaling, and what is refused before launch."""

import json

import pytest
import torch

from hybridengine.model.spec import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfigError, ModelSpec
from tiny_models import make_llama3, make_qwen3


def test_qwen3_has_qk_norm_and_its_own_head_dim(tmp_path):
    spec = ModelSpec.from_pretrained(make_qwen3(tmp_path / "qwen3", vocab=301))
    assert spec.architecture == "Qwen3ForCausalLM"
    assert (spec.head_dim, spec.hidden_size, spec.num_attention_heads) == (64, 128, 4)  # 4 x 64 != 128
    assert spec.qk_layernorm and not spec.qkv_bias and spec.rope_theta == 1e6 and spec.vocab_size == 301


def test_llama3_rope_scaling_matches_hf_inverse_frequencies_exactly(tmp_path):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workers.megatron.rope import rope_inv_freq

    path = make_llama3(tmp_path / "llama3", low_freq_factor=1.5, high_freq_factor=6.0,
                       original_max_position_embeddings=48, factor=4.0)
    spec = ModelSpec.from_pretrained(path)
    scaling = spec.rope_scaling
    assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
            scaling.original_max_position_embeddings) == (4.0, 1.5, 6.0, 48)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(path), "cpu")
    assert attention_factor == 1.0
    ours = rope_inv_freq(spec)
    assert ours.dtype == expected.dtype and torch.equal(ours, expected)
    # The checkpoint's bounds matter: megatron's hard-coded ones (1, 4, 8192) give other frequencies.
    plain = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2).float() / spec.head_dim))
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    megatron_scaled = RotaryEmbedding._apply_scaling(None, plain.clone(), factor=4.0)
    assert not torch.allclose(megatron_scaled, expected)
    assert not torch.allclose(plain, expected)


def test_rope_scaling_in_the_older_rope_scaling_key():
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    }
    spec = ModelSpec.from_hf_config(config)
    assert spec.rope_theta == 500000.0 and spec.rope_scaling.factor == 32.0


def test_unsupported_family_is_refused_listing_the_supported_ones():
    config = {"architectures": ["GemmaForCausalLM"], "vocab_size": 256, "hidden_size": 128}
    with pytest.raises(ModelConfigError) as info:
        ModelSpec.from_hf_config(config, "gemma/config.json")
    message = str(info.value)
    assert "gemma/config.json: architecture ['GemmaForCausalLM'] is not supported" in message
    for architecture in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert architecture in message
    assert sorted(SUPPORTED_ARCHITECTURES) == sorted(json.loads(message.split("supported: ")[1].replace("'", '"')))


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type_is_refused_listing_the_supported_ones(tmp_path, key):
    path = make_llama3(tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters")
    config[key] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"rope_type 'yarn' .* is not supported; supported rope types: "
                                               r"\['default', 'llama3'\]"):
        ModelSpec.from_pretrained(path)
    assert SUPPORTED_ROPE_TYPES == ("default", "llama3")


def test_llama3_rope_without_its_bounds_is_refused():
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    with pytest.raises(ModelConfigError, match=r"rope_type 'llama3' needs .*missing \['low_freq_factor', "
                                               r"'high_freq_factor', 'original_max_position_embeddings'\]"):
        ModelSpec.from_hf_config(config)
