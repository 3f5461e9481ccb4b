"""ModelSpec: what the training engine needs to know about a Hugging Face model.

Read from ``config.json`` of a Llama / Qwen2 / Qwen3 / Mistral-family
decoder-only LM (causal LM, or sequence classification for critics and
reward models), or of a mixture of experts of the Qwen3-MoE / Qwen2-MoE
families (``MoESpec``: routed experts, and Qwen2-MoE's gated shared expert), and checked against a TP/PP layout before any process group
forms, so a bad pairing fails with one message that names the value and what
would work. The spec is also the one place that knows which layers a
pipeline stage holds (``layers_of_stage``) and how many embedding rows the
(possibly padded) vocabulary has (``vocab_rows``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from hybridengine.model.vision import VISION_LANGUAGE_ARCHITECTURES, VisionSpec, read_vision
from hybridengine.parallel.layout import divisors

__all__ = ["ModelSpec", "MoESpec", "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelConfigError", "Llama3RopeScaling",
           "real_vocab_rows"]

# architecture -> (family, has a scalar head)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("llama", False),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
    "LlamaForSequenceClassification": ("llama", True),
    "MistralForSequenceClassification": ("llama", True),
    "Qwen2ForSequenceClassification": ("qwen2", True),
    "Qwen3ForSequenceClassification": ("qwen3", True),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False),
    "Qwen2MoeForCausalLM": ("qwen2_moe", False),
    # vision-language: a Qwen2 language model with mrope, and a vision tower (hybridengine.model.vision)
    **{architecture: (family, False) for architecture, family in VISION_LANGUAGE_ARCHITECTURES.items()},
}
# Families whose attention normalizes each query and key head (RMSNorm over head_dim) before RoPE.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x RoPE: low frequencies divided by ``factor``, a smooth ramp between the two bounds."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts MLP of every decoder layer: ``num_experts`` routed experts, ``topk`` per token.

    The router is a [num_experts, hidden] linear; a token's probabilities are a softmax over all
    experts, of which the top ``topk`` are kept, renormalized to sum to one when ``norm_topk_prob``
    (Qwen3-MoE's released models) and as they are otherwise (Qwen2-MoE). Each expert is a SwiGLU MLP of
    ``expert_ffn_hidden_size``. Qwen2-MoE adds a shared expert that every token goes through
    (``shared_expert_ffn_hidden_size``; 0: none), scaled by a sigmoid gate ([1, hidden]).
    """

    num_experts: int
    topk: int
    expert_ffn_hidden_size: int
    norm_topk_prob: bool
    shared_expert_ffn_hidden_size: int = 0

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_ffn_hidden_size > 0


class ModelConfigError(ValueError):
    """config.json describes a model, or a model/layout pair, that the engine cannot build."""


def real_vocab_rows(vocab_rows: int, vocab_size: int, tensor_parallel: int, tp_rank: int) -> tuple[int, int]:
    """[start, end) of the real ids among TP rank ``tp_rank``'s ``vocab_rows / tensor_parallel`` padded rows."""
    per_rank = vocab_rows // tensor_parallel
    start = min(tp_rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


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
    qk_layernorm: bool = False  # Qwen3: RMSNorm over each query / key head
    rope_scaling: Llama3RopeScaling | None = None
    # Embedding / output-layer rows; None: the vocabulary is not padded (see with_padded_vocab).
    padded_vocab_size: int | None = None
    moe: MoESpec | None = None  # a mixture of experts: every layer's MLP is routed experts
    # Multimodal RoPE: head_dim / 2 frequencies split into (temporal, height, width) sections, each turned by
    # its own position stream; None: 1-D RoPE
    mrope_section: tuple[int, ...] | None = None
    vision: VisionSpec | None = None  # a vision-language model's image side

    @property
    def is_multimodal(self) -> bool:
        return self.vision is not None

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def is_value_model(self) -> bool:
        return self.num_labels > 0

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and output layer: the padded vocabulary (ids >= vocab_size are padding)."""
        return self.padded_vocab_size or self.vocab_size

    def real_vocab_rows(self, tensor_parallel: int, tp_rank: int) -> tuple[int, int]:
        """[start, end) of the real (unpadded) vocabulary ids in TP rank ``tp_rank``'s shard of ``vocab_rows``."""
        return real_vocab_rows(self.vocab_rows, self.vocab_size, tensor_parallel, tp_rank)

    def with_padded_vocab(self, divisible_by: int | None, tensor_parallel: int) -> "ModelSpec":
        """This spec with the vocabulary padded as megatron's ``make_vocab_size_divisible_by`` does.

        Rows are padded up to a multiple of ``divisible_by`` x ``tensor_parallel``,
        so every TP size that divides that multiple works. Padded ids never
        take probability mass (their logits are masked) and checkpoints keep
        the real vocabulary only. ``divisible_by`` None: no padding (this spec).
        """
        if divisible_by is None:
            return self
        if not isinstance(divisible_by, int) or divisible_by < 1:
            raise ModelConfigError(f"make_vocab_size_divisible_by must be a positive integer, got {divisible_by!r}")
        multiple = divisible_by * tensor_parallel
        padded = -(-self.vocab_size // multiple) * multiple
        return replace(self, padded_vocab_size=padded)

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
        vision = read_vision(config, source) if architecture in VISION_LANGUAGE_ARCHITECTURES else None
        if vision is not None:  # the language model's sizes are its text_config's
            config = {**config, **(config.get("text_config") or {}), "architectures": architectures}
        activation = config.get("hidden_act", "silu")
        if activation != "silu":
            raise ModelConfigError(f"{source}: hidden_act {activation!r} is not supported; only 'silu' (SwiGLU)")
        rope_theta, rope_scaling = _read_rope(config, source)
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        qkv_bias = True if family in QKV_BIAS_FAMILIES else bool(config.get("attention_bias", False))
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
            qk_layernorm=family in QK_NORM_FAMILIES,
            rope_scaling=rope_scaling,
            moe=_read_moe(config, source) if family in MOE_FAMILIES else None,
            mrope_section=_read_mrope(config, head_dim, source) if vision is not None else None,
            vision=vision,
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
    def check_layout(self, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int = 1,
                     expert_tensor_parallel: int | None = None) -> None:
        """Raise if the model cannot be split ``tensor_parallel`` x ``pipeline_parallel`` ways, its experts
        ``expert_parallel`` ways (whole experts per rank) and each expert ``expert_tensor_parallel`` ways
        (None: as ``tensor_parallel``, megatron's default)."""
        tp, pp = tensor_parallel, pipeline_parallel
        checks = [
            ("attention heads", self.num_attention_heads),
            ("key/value heads (query groups)", self.num_query_groups),
            ("FFN hidden size", self.ffn_hidden_size),
            ("vocab size", self.vocab_rows),
        ]
        if self.moe is None:
            if expert_parallel != 1 or expert_tensor_parallel not in (None, 1):
                raise ModelConfigError(
                    f"expert_parallel {expert_parallel} / expert_tensor_parallel {expert_tensor_parallel} need a "
                    f"mixture-of-experts model; {self.architecture} is dense (leave both at their defaults)")
        else:
            checks = checks[:2] + [("shared expert's FFN hidden size", self.moe.shared_expert_ffn_hidden_size)] \
                + checks[3:]
            self._check_experts(expert_parallel, tp if expert_tensor_parallel is None else expert_tensor_parallel)
        for what, size in checks:
            if size % tp != 0:
                valid = [d for d in divisors(size) if all(s % d == 0 for _, s in checks)]
                hint = ""
                if what == "vocab size":
                    hint = (" (the vocabulary is not padded: pick a TP size that divides it, or pad it: "
                            "engine make_vocab_size_divisible_by: 128)" if self.padded_vocab_size is None else
                            f" (padded from {self.vocab_size}: pad to a multiple of this TP size)")
                raise ModelConfigError(
                    f"tensor_parallel {tp} does not divide the {what} {size}{hint}; "
                    f"TP sizes that divide every split dimension of this model: {valid}"
                )
        if self.vision is not None and pp != 1:
            raise ModelConfigError(
                f"pipeline_parallel {pp}: a vision-language model ({self.architecture}) trains at pipeline_parallel 1 "
                "for now (the vision tower runs on the first stage, which is the only one); split it with "
                "tensor_parallel instead")
        if self.num_layers % pp != 0:
            raise ModelConfigError(
                f"pipeline_parallel {pp} does not divide the {self.num_layers} layers; "
                f"valid PP sizes: {divisors(self.num_layers)}"
            )

    def _check_experts(self, ep: int, etp: int) -> None:
        moe = self.moe
        for name, value in (("expert_parallel", ep), ("expert_tensor_parallel", etp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if moe.num_experts % ep:
            raise ModelConfigError(f"expert_parallel {ep} does not divide the {moe.num_experts} experts; "
                                   f"valid EP sizes: {divisors(moe.num_experts)}")
        if moe.expert_ffn_hidden_size % etp:
            raise ModelConfigError(f"expert_tensor_parallel {etp} does not divide the experts' FFN hidden size "
                                   f"{moe.expert_ffn_hidden_size}; valid sizes: {divisors(moe.expert_ffn_hidden_size)}")

    def layers_of_stage(self, pp_rank: int, pipeline_parallel: int) -> range:
        """The global layer indices that pipeline stage ``pp_rank`` of ``pipeline_parallel`` holds.

        The only place that splits layers over stages: everything else
        (HF mapping, parameter catalogue, resharder) asks here.
        """
        per_stage = self.num_layers // pipeline_parallel
        return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)

    def stage_of_layer(self, layer: int, pipeline_parallel: int) -> tuple[int, int]:
        """(pipeline stage, local index in it) of global layer ``layer``; the inverse of ``layers_of_stage``."""
        for stage in range(pipeline_parallel):
            layers = self.layers_of_stage(stage, pipeline_parallel)
            if layer in layers:
                return stage, layers.index(layer)
        raise ValueError(f"layer {layer} is outside the model's {self.num_layers} layers")


def _read_moe(config: dict, source: str) -> MoESpec:
    """The experts of a Qwen3-MoE / Qwen2-MoE config.json; refuses what the engine does not build."""
    layers = int(config["num_hidden_layers"])
    dense = sorted(set(config.get("mlp_only_layers") or []))
    step = int(config.get("decoder_sparse_step", 1))
    if dense or step != 1:
        raise ModelConfigError(
            f"{source}: every decoder layer must be a mixture of experts; mlp_only_layers {dense} and "
            f"decoder_sparse_step {step} make some of the {layers} layers dense (supported: [] and 1)")
    num_experts = int(config.get("num_experts", config.get("num_local_experts", 0)))
    topk = int(config.get("num_experts_per_tok", 0))
    if num_experts < 1 or not 1 <= topk <= num_experts:
        raise ModelConfigError(f"{source}: need num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, "
                               f"got {num_experts} experts and {topk} per token")
    return MoESpec(
        num_experts=num_experts,
        topk=topk,
        expert_ffn_hidden_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        shared_expert_ffn_hidden_size=int(config.get("shared_expert_intermediate_size") or 0),
    )


def _read_mrope(config: dict, head_dim: int, source: str) -> tuple[int, ...]:
    """A vision-language model's mrope sections: they split the head_dim / 2 rotary frequencies."""
    rope = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ModelConfigError(f"{source}: mrope_section {list(section)} must be three sizes that sum to head_dim / 2 "
                               f"= {head_dim // 2}")
    return section


def _read_rope(config: dict, source: str) -> tuple[float, Llama3RopeScaling | None]:
    """RoPE theta and scaling, from transformers 5's ``rope_parameters`` or older ``rope_theta`` / ``rope_scaling``."""
    rope = dict(config.get("rope_parameters") or {})
    rope.update(config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: rope_type {rope_type!r} (RoPE settings {rope!r}) is not supported; "
            f"supported rope types: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    missing = [key for key in _LLAMA3_KEYS if key not in rope]
    if missing:
        raise ModelConfigError(f"{source}: rope_type 'llama3' needs {list(_LLAMA3_KEYS)}; missing {missing} in {rope!r}")
    scaling = Llama3RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    if scaling.high_freq_factor <= scaling.low_freq_factor or scaling.factor <= 0:
        raise ModelConfigError(f"{source}: llama3 RoPE needs factor > 0 and high_freq_factor > low_freq_factor, "
                               f"got {scaling}")
    return theta, scaling
