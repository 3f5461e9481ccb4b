"""Build the megatron-core GPTModel of one pipeline stage from a ModelSpec.

Llama / Qwen2 / Qwen3 family: RMSNorm, SwiGLU, RoPE (theta from the config,
Llama 3.x scaling), GQA, optional QKV bias, optional q/k norm (Qwen3), tied
or untied embeddings, a vocabulary padded to ``spec.vocab_rows``. The local layer spec is used
unless transformer-engine is installed and a GPU is present. A value model
(critic, reward model) swaps the vocab output layer for a scalar head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridengine.device import accelerator_available
from hybridengine.model.spec import ModelSpec
from workers.megatron.rope import install_rope

__all__ = ["build_gpt_stage", "gpt_config", "gpt_model", "layer_spec", "ValueHead"]


class ValueHead(torch.nn.Module):
    """A [num_labels, hidden] linear head, replicated on every TP rank.

    It takes the place of GPTModel's output layer and answers its call
    signature. Its input is the full hidden state on every TP rank (no
    sequence parallelism at the output), so its gradient is identical on all
    of them and needs no TP reduction.
    """

    def __init__(self, hidden_size: int, num_labels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(num_labels, hidden_size, dtype=dtype))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return F.linear(hidden_states, self.weight), None


def layer_spec(qk_layernorm: bool = False):
    """megatron's layer spec; ``qk_layernorm``: an RMSNorm over each query and key head (Qwen3)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if accelerator_available():
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
        except ImportError:
            pass
    return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)


def gpt_config(spec: ModelSpec, tp: int, pp: int, dtype: torch.dtype = torch.float32, initialize: bool = True,
               recompute_granularity: str | None = None, recompute_num_layers: int = 1):
    """The TransformerConfig of a Llama-family model at TP x PP; training and generation share it.

    ``dtype`` bf16 sets megatron's bf16 flag with it (parameters, activations and pipeline messages in
    bf16; attention softmax in fp32). ``recompute_granularity`` "full" / "selective": megatron's
    activation recomputation ("full": blocks of ``recompute_num_layers`` layers, the uniform method).
    """
    from megatron.core.transformer import TransformerConfig

    recompute = {}
    if recompute_granularity == "full":
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform",
                     "recompute_num_layers": recompute_num_layers}
    elif recompute_granularity == "selective":
        recompute = {"recompute_granularity": "selective"}
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The fused paths go through torch.compile (seconds at start) and gain nothing on CPU.
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not accelerator_available(),
        perform_initialization=initialize,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        **recompute,
    )


def gpt_model(spec: ModelSpec, config, pre_process: bool, post_process: bool, tied: bool, **kwargs):
    """megatron's GPTModel of one stage of ``spec`` (the padded vocabulary, q/k norm, its RoPE); training and
    generation build theirs here. ``kwargs`` go to GPTModel (``pg_collection``)."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec.qk_layernorm),
        vocab_size=spec.vocab_rows,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        parallel_output=True,
        **kwargs,
    )
    install_rope(model, spec)
    # megatron's torch norms keep fp32 weights whatever params_dtype says; in bf16 every parameter is bf16,
    # as Float16Module makes a trained stage and as vLLM holds the model (RoPE frequencies are no buffer: fp32).
    return model.to(dtype=config.params_dtype)


def build_gpt_stage(spec: ModelSpec, tp: int, pp: int, pp_rank: int, dtype: torch.dtype = torch.float32, *,
                    pg_collection, **recompute):
    """One training stage of ``spec`` in ``dtype`` on the grid's groups (``pg_collection``); ``recompute``:
    gpt_config's recompute settings."""
    config = gpt_config(spec, tp, pp, dtype, **recompute)
    tied = spec.tie_word_embeddings and not spec.is_value_model
    model = gpt_model(spec, config, pp_rank == 0, pp_rank == pp - 1, tied, pg_collection=pg_collection)
    if spec.is_value_model and pp_rank == pp - 1:
        model.output_layer = ValueHead(spec.hidden_size, spec.num_labels, dtype)
    return config, model
