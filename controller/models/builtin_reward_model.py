"""``builtin:tiny-deberta-reward``: a tiny random DeBERTa-v2 reward model with a tokenizer of its own.

The shape of OpenAssistant's DeBERTa-v3 reward models (relative attention, no absolute positions, a
CLS pooler, one label) at a few thousand parameters, and a word-level tokenizer that pairs texts as
BERT does (``[CLS] a [SEP] b [SEP]``), so a job exercises the path a real hub reward model takes: an
architecture the megatron engine does not hold, and a vocabulary that is not the policy's. Its scores
are random; it is for trying the pipeline, not for learning.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["ARITHMETIC", "SENTENCES", "make_deberta_reward_model", "save_word_tokenizer"]

# What the word-level tokenizer knows; other words become [UNK].
SENTENCES = [
    "what is two plus two ? the answer is four .",
    "name a colour of the sky . the sky is blue , sometimes grey .",
    "write a short poem about the sea . waves come and go , the sea is calm .",
    "how many legs does a cat have ? a cat has four legs .",
    "tool said : 42 . so the result is 42 .",
]
# The built-in model also knows the numbers 0-99 and the operators of the built-in arithmetic task.
ARITHMETIC = [" ".join(str(n) for n in range(100)) + " + - * / = #"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]  # ids 0-3


def save_word_tokenizer(path: str | Path, chat_template: str | None = None, sentences: list[str] = SENTENCES) -> Path:
    """A ``PreTrainedTokenizerFast`` of lower-cased words and punctuation, right-padded with [PAD]."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(sentences, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", padding_side="right")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return Path(path)


def make_deberta_reward_model(path: str | Path, num_labels: int = 1, seed: int = 0, chat_template: str | None = None,
                              tokenizer_from: str | None = None, sentences: list[str] = SENTENCES) -> str:
    """A random ``DebertaV2ForSequenceClassification`` with its tokenizer in ``path``.

    ``tokenizer_from``: copy that tokenizer (e.g. the policy's) instead of the word-level one, so the
    reward model reads the policy's ids as they are.
    """
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2ForSequenceClassification

    path = Path(path)
    if tokenizer_from is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
        tokenizer.save_pretrained(str(path))
    else:
        save_word_tokenizer(path, chat_template, sentences)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    torch.manual_seed(seed)
    config = DebertaV2Config(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"],
        position_biased_input=False, norm_rel_ebd="layer_norm", max_relative_positions=-1, type_vocab_size=0,
        pad_token_id=tokenizer.pad_token_id, num_labels=num_labels, initializer_range=0.3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    DebertaV2ForSequenceClassification(config).save_pretrained(str(path), safe_serialization=True)
    return str(path)
