"""A tokenizer with a chat template, built on the spot (no hub), and a tiny chat model around it.

The template writes the BOS token itself, as Llama 3's and many others do: a
loader that re-tokenized the rendered text with special tokens would put a
second BOS in front, which the token-equality tests catch.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "make_chat_model", "save_chat_tokenizer"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_chat_tokenizer(path: str | Path, vocab_size: int = 256, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """The built-in character tokenizer (controller.models.char_tokenizer) with ``chat_template`` set, saved in ``path``."""
    from transformers import AutoTokenizer

    from controller.models.char_tokenizer import save_char_tokenizer

    save_char_tokenizer(path, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))
    return Path(path)


def make_chat_model(path: str | Path, chat_template: str | None = CHAT_TEMPLATE) -> str:
    """The built-in tiny model (``builtin:tiny-arithmetic``, max 128 positions) with a chat tokenizer, in ``path``."""
    from controller.models.builtin import resolve_model_path

    model = resolve_model_path("builtin:tiny-arithmetic", path)
    save_chat_tokenizer(model, 256, chat_template)
    return model
