"""RoPE inverse frequencies as Hugging Face computes them, installed into megatron's RotaryEmbedding.

megatron-core 0.16.1's RotaryEmbedding knows Llama 3.x scaling only with
hard-coded bounds (low_freq_factor 1, high_freq_factor 4, original context
8192) and takes just the factor. A checkpoint may set other bounds, so the
inverse frequencies are computed here, step for step as transformers'
``_compute_llama3_parameters`` does (bit-identical), and put in place of
megatron's before the first forward (its cos/sin cache is filled lazily).
"""

from __future__ import annotations

import math

import torch

from hybridengine.model_spec import ModelSpec

__all__ = ["rope_inv_freq", "install_rope"]


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies of the model's RoPE (plain, or Llama 3.x scaled)."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by the factor, short ones kept, a ramp between.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def install_rope(model: torch.nn.Module, spec: ModelSpec) -> None:
    """Give ``model``'s (a GPTModel stage) RotaryEmbedding the checkpoint's scaled frequencies.

    Plain RoPE is left to megatron (it computes the same values).
    """
    if spec.rope_scaling is None:
        return
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise RuntimeError("the GPT stage has no rotary_pos_emb; Llama 3.x RoPE scaling needs position_embedding_type 'rope'")
    rotary.inv_freq = rope_inv_freq(spec).to(rotary.inv_freq.device)
    cached = getattr(type(rotary).forward, "cache_clear", None)  # megatron memoizes forward per sequence length
    if cached is not None:
        cached()
