"""Build the megatron-core GPTModel of one pipeline stage from a ModelSpec.

Llama / Qwen2 / Qwen3 family: RMSNorm, SwiGLU, RoPE (theta from the config,
Llama 3.x scaling), GQA, optional QKV bias, optional q/k norm (Qwen3), tied
or untied embeddings, a vocabulary padded to ``spec.vocab_rows``. The local layer spec is used
unless transformer-engine is installed and a GPU is present. A value model
(critic, reward model) swaps the vocab output layer for a scalar head.

A vision-language model (Qwen2.5-VL) is its language model with multimodal
RoPE (three position streams) and, on the first stage, transformers' vision
tower and merger (``workers.megatron.vision_tower``).

Mixtures of experts (Qwen3-MoE, Qwen2-MoE) get megatron's MoE layer in every
decoder layer: a top-k softmax router, the experts as a sequential MLP
(grouped GEMM with transformer-engine on a GPU), an optional gated shared
expert, token dispatch by all-to-all over the expert-parallel group. With
TP > 1 an MoE model runs sequence-parallel, as megatron requires.
"""

from __future__ import annotations

import copy
import importlib.util

import torch
import torch.nn.functional as F

from hybridengine.device import accelerator_available, compute_device
from hybridengine.model.spec import ModelSpec
from workers.megatron.config import RouterOptions
from workers.megatron.rope import install_rope
from workers.megatron.vision_tower import VISION_MODULE, build_vision_tower

__all__ = ["build_gpt_stage", "gpt_config", "gpt_model", "layer_spec", "moe_config", "uses_transformer_engine",
           "ValueHead"]


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


def uses_transformer_engine() -> bool:
    """transformer-engine's layers (fused norms, grouped expert GEMM): with a GPU and the package installed."""
    return accelerator_available() and importlib.util.find_spec("transformer_engine") is not None


def layer_spec(qk_layernorm: bool = False, num_experts: int | None = None, packed: bool = False,
               attention: str = "local"):
    """megatron's layer spec; ``qk_layernorm``: an RMSNorm over each query and key head (Qwen3);
    ``num_experts``: a mixture-of-experts MLP (None: dense); ``packed``: packed sequences and context
    parallelism, run by the engine's core attention (``workers.megatron.context_attention``) in place of
    megatron's, or with ``attention`` "transformer_engine" by transformer-engine's own (its THD and CP kernels)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if uses_transformer_engine():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=bool(num_experts),
                                                          qk_layernorm=qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm", qk_layernorm=qk_layernorm)
    if packed and attention == "transformer_engine":
        if not uses_transformer_engine():
            raise ValueError("attention 'transformer_engine' needs transformer-engine and a GPU; this process has "
                             f"{'no GPU' if not accelerator_available() else 'no transformer_engine package'}: "
                             "use attention 'local'")
        return spec  # transformer-engine's TEDotProductAttention takes THD and CP itself
    if packed:
        from workers.megatron.context_attention import ContextParallelAttention

        spec = copy.deepcopy(spec)  # megatron may hand out a shared spec: other models keep its attention
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return spec


def moe_config(spec: ModelSpec, tp: int, ep: int = 1, etp: int | None = None,
               router: RouterOptions | None = None) -> dict:
    """TransformerConfig's mixture-of-experts settings for ``spec`` (empty for a dense model).

    Routing as the HF families route: a softmax over every expert, the top k kept, renormalized when
    ``norm_topk_prob`` (megatron's top-k-then-softmax is the same probabilities) and not otherwise
    (megatron's pre-softmax). Dropless unless ``router.capacity_factor`` is set.
    """
    if spec.moe is None:
        return {}
    moe, router = spec.moe, router or RouterOptions()
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.has_shared_expert,
        moe_router_load_balancing_type="aux_loss" if router.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=router.aux_loss_coeff,
        moe_z_loss_coeff=router.z_loss_coeff or None,
        moe_expert_capacity_factor=router.capacity_factor,
        moe_token_dispatcher_type="alltoall",
        moe_enable_routing_replay=True,  # idle until a batch brings routes (workers.megatron.routing_replay)
        moe_grouped_gemm=uses_transformer_engine(),
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if etp is None else etp,
        # megatron trains MoE with TP only sequence-parallel: each TP rank routes its own slice of the tokens.
        sequence_parallel=tp > 1,
    )


def gpt_config(spec: ModelSpec, tp: int, pp: int, dtype: torch.dtype = torch.float32, initialize: bool = True,
               recompute_granularity: str | None = None, recompute_num_layers: int = 1, ep: int = 1,
               etp: int | None = None, router: RouterOptions | None = None, cp: int = 1):
    """The TransformerConfig of a Llama-family model at TP x PP (x CP); training and generation share it.

    ``dtype`` bf16 sets megatron's bf16 flag with it (parameters, activations and pipeline messages in
    bf16; attention softmax in fp32). ``recompute_granularity`` "full" / "selective": megatron's
    activation recomputation ("full": blocks of ``recompute_num_layers`` layers, the uniform method).
    ``ep`` / ``etp`` / ``router``: a mixture of experts' parallelism and routing options (``moe_config``).
    ``cp``: context parallelism (megatron's RoPE and loss scaling read it; transformer-engine's attention
    exchanges K/V point to point, "p2p").
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
        context_parallel_size=cp,
        **({"cp_comm_type": "p2p"} if cp > 1 else {}),
        # a vision-language model's language model: multimodal RoPE over (temporal, height, width) sections
        **({"mrope_section": list(spec.mrope_section)} if spec.mrope_section else {}),
        **recompute,
        **moe_config(spec, tp, ep, etp, router),
    )


def gpt_model(spec: ModelSpec, config, pre_process: bool, post_process: bool, tied: bool, packed: bool = False,
              attention: str = "local", **kwargs):
    """megatron's GPTModel of one stage of ``spec`` (the padded vocabulary, q/k norm, its RoPE); training and
    generation build theirs here. ``packed`` / ``attention``: packed sequences and their attention
    (``layer_spec``). ``kwargs`` go to GPTModel (``pg_collection``)."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec.qk_layernorm, spec.moe.num_experts if spec.moe else None, packed,
                                          attention),
        vocab_size=spec.vocab_rows,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="mrope" if spec.mrope_section else "rope",
        rotary_base=int(spec.rope_theta),
        parallel_output=True,
        **kwargs,
    )
    install_rope(model, spec)
    # megatron's torch norms keep fp32 weights whatever params_dtype says; in bf16 every parameter is bf16,
    # as Float16Module makes a trained stage and as vLLM holds the model (RoPE frequencies are no buffer: fp32).
    # Those torch norms are also built on the CPU: the whole stage goes to this process's device.
    return model.to(device=compute_device(), dtype=config.params_dtype)


def build_gpt_stage(spec: ModelSpec, tp: int, pp: int, pp_rank: int, dtype: torch.dtype = torch.float32, *,
                    pg_collection, packed: bool = False, attention: str = "local", **settings):
    """One training stage of ``spec`` in ``dtype`` on the grid's groups (``pg_collection``); ``packed``: it runs
    packed sequences (and context parallelism, ``settings``' ``cp``) with ``attention``'s kernels; ``settings``:
    gpt_config's recompute, expert and CP settings."""
    config = gpt_config(spec, tp, pp, dtype, **settings)
    tied = spec.tie_word_embeddings and not spec.is_value_model
    model = gpt_model(spec, config, pp_rank == 0, pp_rank == pp - 1, tied, packed, attention,
                      pg_collection=pg_collection)
    if spec.is_value_model and pp_rank == pp - 1:
        model.output_layer = ValueHead(spec.hidden_size, spec.num_labels, dtype).to(compute_device())
    if spec.vision is not None and pp_rank == 0:  # a vision-language model: the image side on the first stage
        setattr(model, VISION_MODULE, build_vision_tower(spec, dtype, compute_device()))
    return config, model
