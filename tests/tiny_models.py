"""Tiny Llama-family checkpoints made on the spot, and RL batches for them."""

from pathlib import Path

import torch


def make_llama(path: Path, tie: bool = False, qkv_bias: bool = False, layers: int = 4, seed: int = 0,
               classification: bool = False, heads: int = 4, kv_heads: int = 2, head_dim: int = 32) -> Path:
    """A random Llama (or Qwen2 when ``qkv_bias``) checkpoint in HF format, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=256, hidden_size=head_dim * heads, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=tie, initializer_range=0.05,
    )
    if qkv_bias:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif classification:
        model = LlamaForSequenceClassification(LlamaConfig(num_labels=1, pad_token_id=0, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():  # norms away from 1 and non-zero biases, so a mapping slip shows
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_rl_batch(batch_size: int = 8, prompt_length: int = 6, response_length: int = 5, seed: int = 0):
    """Left-padded prompts, right-padded responses, as rollout hands them over."""
    from workers import DataProto

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 256, (batch_size, prompt_length), generator=g)
    responses = torch.randint(1, 256, (batch_size, response_length), generator=g)
    prompt_mask = torch.ones(batch_size, prompt_length, dtype=torch.long)
    response_mask = torch.ones(batch_size, response_length, dtype=torch.long)
    for i in range(batch_size):
        prompt_mask[i, : i % 3] = 0  # 0-2 pads on the left
        cut = response_length - (i % 4)  # 0-3 pads on the right
        response_mask[i, cut:] = 0
    prompts = prompts * prompt_mask
    responses = responses * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto({
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": response_mask,
    })
