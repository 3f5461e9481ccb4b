"""The random Llama-shaped checkpoints the benchmarks run on, written on the spot."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPES = {
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}


def make_checkpoint(name: str, path: Path, tokenizer: bool = False, max_positions: int = 512) -> int:
    """An HF checkpoint of shape ``name`` (seed 0) in ``path``, with a char tokenizer if asked; returns its size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=1,
                                         eos_token_id=2, pad_token_id=0, **SHAPES[name]))
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        from controller.models.char_tokenizer import save_char_tokenizer

        save_char_tokenizer(path, SHAPES[name]["vocab_size"])
    return sum(p.numel() for p in model.parameters())
