"""A character-level tokenizer built on the spot: no download, any vocabulary size.

The built-in tasks and the tests need a real Hugging Face tokenizer (vLLM and
the rollout read pad, EOS and the decoder from it) for tiny models whose
vocabulary is a few hundred ids. Every id decodes to exactly one character
(or a special token), so any sampled id is printable.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SPECIAL_TOKENS", "save_char_tokenizer"]

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2


def _characters(count: int) -> list[str]:
    chars, code = [], 32
    while len(chars) < count:
        ch = chr(code)
        if ch.isprintable() and not ch.isspace() or ch == " ":
            chars.append(ch)
        code += 1
    return chars


def save_char_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """Write a ``PreTrainedTokenizerFast`` with ``vocab_size`` ids into ``path``.

    Ids 0-2 are pad, BOS and EOS; id 3 on are printable characters, ASCII
    first (so digits, letters and ``+-*/=`` are all there from 3 + 95 ids).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 96:
        raise ValueError(f"vocab_size {vocab_size} is too small: the printable ASCII set needs at least 99 ids")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in _characters(vocab_size - len(SPECIAL_TOKENS)):
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>",
    )
    fast.save_pretrained(str(path))
    return Path(path)
