"""RoPE inverse frequencies with the checkpoint's Llama 3.x scaling, installed into megatron's RotaryEmbedding.

megatron-core 0.16.1's RotaryEmbedding applies Llama 3.x scaling with its
defaults for the frequency bounds (low_freq_factor 1, high_freq_factor 4,
original context 8192) and takes only the factor from its caller. A
checkpoint may set other bounds, so the inverse frequencies are computed
here with megatron's own scaling function given all four values (it follows
transformers' ``_compute_llama3_parameters``; a test holds the two
bit-identical) and put in place of megatron's before the first forward.
"""

from __future__ import annotations

import torch

from hybridengine.model.spec import ModelSpec
from workers.megatron.megatron_compat import llama3_scaled_inv_freq, replace_rotary_inv_freq

__all__ = ["rope_inv_freq", "install_rope"]


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies of the model's RoPE (plain, or Llama 3.x scaled)."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    return llama3_scaled_inv_freq(inv_freq, factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
                                  high_freq_factor=scaling.high_freq_factor,
                                  original_max_position_embeddings=scaling.original_max_position_embeddings)


def install_rope(model: torch.nn.Module, spec: ModelSpec) -> None:
    """Give ``model``'s (a GPTModel stage) RotaryEmbedding the checkpoint's scaled frequencies.

    Plain RoPE is left to megatron (it computes the same values).
    """
    if spec.rope_scaling is None:
        return
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise RuntimeError("the GPT stage has no rotary_pos_emb; Llama 3.x RoPE scaling needs position_embedding_type 'rope'")
    replace_rotary_inv_freq(rotary, rope_inv_freq(spec))

