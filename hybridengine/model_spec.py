"""ModelSpec: what the training engine needs to know about a Hugging Face model.

Read from ``config.json`` of a Llama / Qwen2 / Mistral-family decoder-only LM
(causal LM, or sequence classification for critics and reward models) and
checked against a TP/PP layout before any process group forms, so a bad
pairing fails with one message that names the value and what would work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelSpec", "SUPPORTED_ARCHITECTURES", "ModelConfigError"]

# architecture -> (family, has a scalar head)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("llama", False),
    "Qwen2ForCausalLM": ("qwen2", False),
    "LlamaForSequenceClassification": ("llama", True),
    "MistralForSequenceClassification": ("llama", True),
    "Qwen2ForSequenceClassification": ("qwen2", True),
}


class ModelConfigError(ValueError):
    """config.json describes a model, or a model/layout pair, that the engine cannot build."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    norm_epsilon: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    num_labels: int = 0  # > 0: a sequence-classification (scalar head) model

    @property
    def is_value_model(self) -> bool:
        return self.num_labels > 0

    @property
    def kv_channels(self) -> int:
        return self.head_dim

    # ------------------------------------------------------------- loading
    @classmethod
    def from_hf_config(cls, config: dict, source: str = "config.json") -> "ModelSpec":
        architectures = config.get("architectures") or []
        known = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise ModelConfigError(
                f"{source}: architecture {architectures or config.get('model_type')!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = known[0]
        family, value_head = SUPPORTED_ARCHITECTURES[architecture]
        activation = config.get("hidden_act", "silu")
        if activation != "silu":
            raise ModelConfigError(f"{source}: hidden_act {activation!r} is not supported; only 'silu' (SwiGLU)")
        if config.get("rope_scaling"):
            raise ModelConfigError(
                f"{source}: rope_scaling {config['rope_scaling']!r} is not supported yet; only plain RoPE"
            )
        # transformers >= 5 writes RoPE settings as rope_parameters {rope_theta, rope_type}; older ones rope_theta.
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ModelConfigError(
                f"{source}: rope_parameters {rope!r} (rope_type {rope['rope_type']!r}) are not supported yet; "
                f"only plain RoPE (rope_type 'default')"
            )
        rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        qkv_bias = True if family == "qwen2" else bool(config.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            ffn_hidden_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_query_groups=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            # HF writes id2label (one entry per label), not num_labels, into config.json.
            num_labels=(len(config["id2label"]) if "id2label" in config else int(config.get("num_labels", 1)))
            if value_head else 0,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelSpec":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelConfigError(f"no config.json in {path}; expected a Hugging Face model directory")
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{config_path} is not valid JSON: {exc}") from None
        return cls.from_hf_config(config, str(config_path))

    # ---------------------------------------------------------- validation
    def check_layout(self, tensor_parallel: int, pipeline_parallel: int) -> None:
        """Raise if the model cannot be split ``tensor_parallel`` x ``pipeline_parallel`` ways."""
        tp, pp = tensor_parallel, pipeline_parallel
        checks = [
            ("attention heads", self.num_attention_heads),
            ("key/value heads (query groups)", self.num_query_groups),
            ("FFN hidden size", self.ffn_hidden_size),
            ("vocab size", self.vocab_size),
        ]
        for what, size in checks:
            if size % tp != 0:
                valid = [d for d in _divisors(size) if all(s % d == 0 for _, s in checks)]
                hint = " (the vocabulary is not padded: pick a TP size that divides it)" if what == "vocab size" else ""
                raise ModelConfigError(
                    f"tensor_parallel {tp} does not divide the {what} {size}{hint}; "
                    f"TP sizes that divide every split dimension of this model: {valid}"
                )
        if self.num_layers % pp != 0:
            raise ModelConfigError(
                f"pipeline_parallel {pp} does not divide the {self.num_layers} layers; "
                f"valid PP sizes: {_divisors(self.num_layers)}"
            )

    def layers_of_stage(self, pp_rank: int, pipeline_parallel: int) -> range:
        per_stage = self.num_layers // pipeline_parallel
        return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
