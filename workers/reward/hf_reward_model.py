"""HFRewardModel: any Hugging Face sequence classifier as a reward (or cost) model, data-parallel.

The megatron ``RewardModel`` holds Llama / Mistral / Qwen-family value heads at any TP/PP. This worker
runs everything else ``transformers.AutoModelForSequenceClassification`` loads (DeBERTa, BERT-style
encoders, other decoders) forward-only: every rank holds the whole model in the job's precision and
scores its equal share of the batch (DP_COMPUTE_PROTO), ``micro_batch_size`` sequences per forward pass.

The reward model reads text through its own tokenizer. When that tokenizer's vocabulary differs from
the policy's (``tokenizer_path``), each row's prompt and response are decoded with the policy's
tokenizer and re-encoded with the reward model's: through its chat template (a user turn, then an
assistant turn) where it has one, else as a text pair ``tokenizer(prompt, response)``, the way
OpenAssistant's DeBERTa reward models are called. With the same vocabulary the policy's ids are scored
as they are. The score is ``logits[:, 0]`` of a one-label head, placed on the last valid response token
of ``token_level_scores`` like every other reward worker's.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from workers.base_worker import BaseWorker
from workers.data_proto import DataProto
from workers.dispatch import Dispatch
from workers.megatron.config import PRECISIONS
from workers.register import register
from workers.reward.rule_reward import last_token_scores

__all__ = ["HFRewardModel", "check_reward_checkpoint", "check_reward_options", "same_vocabulary"]

REQUIRED_KEYS = ("prompts", "responses", "attention_mask", "response_mask")
# transformers' "no limit" model_max_length is 1e30; anything this large is not a real limit.
_NO_LIMIT = 10**9


def check_reward_options(precision: Any = "bf16", micro_batch_size: Any = 8, score_key: Any = "rm_scores",
                         max_length: Any = None) -> None:
    """Raise ValueError, naming the value and what is valid, for a setting HFRewardModel cannot take."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    if not isinstance(score_key, str) or not score_key or score_key == "token_level_scores":
        raise ValueError(f"score_key must be a non-empty name other than 'token_level_scores', got {score_key!r}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be a positive integer or None (the tokenizer's model_max_length), "
                         f"got {max_length!r}")


def check_reward_checkpoint(model_path: str):
    """The checkpoint's ``transformers`` config, read without loading weights; refused (ValueError) unless
    it is a sequence classifier with exactly one label."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a Hugging Face model config from {model_path!r}: {exc}") from None
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"a reward model must be a *ForSequenceClassification checkpoint (one-label score head); "
                         f"{model_path} is a {'/'.join(architectures)}")
    if config.num_labels != 1:
        raise ValueError(f"a reward model needs num_labels=1 (one scalar score); {model_path} has "
                         f"num_labels={config.num_labels}")
    return config


def same_vocabulary(tokenizer_a, tokenizer_b) -> bool:
    """Whether two tokenizers map every token to the same id (so one's ids mean the same to the other)."""
    return tokenizer_a is tokenizer_b or tokenizer_a.get_vocab() == tokenizer_b.get_vocab()


class HFRewardModel(BaseWorker):
    """Sequence scores from any one-label ``AutoModelForSequenceClassification`` checkpoint, data-parallel.

    ``tokenizer_path``: the policy's tokenizer, the one that made the batch's ids; None means the batch
    was tokenized with the reward model's own tokenizer (ids used as they are). ``precision``: "bf16" or
    "fp32" for the weights and activations; scores are always returned in fp32. ``max_length``: tokens
    per scored sequence at most (None: the reward tokenizer's ``model_max_length``, if it has a real one),
    truncated on the reward tokenizer's ``truncation_side``.

    Invariants: each rank holds the whole model on ``self.device`` and no gradient state; each row is
    scored on its own (padding only changes the batch shape, never a score: the attention mask hides
    it); ``compute_rm_score`` returns one score per input row, in input order.
    """

    def __init__(self, model_path: str, tokenizer_path: str | None = None, precision: str = "bf16",
                 micro_batch_size: int = 8, score_key: str = "rm_scores", max_length: int | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_reward_options(precision, micro_batch_size, score_key, max_length)
        check_reward_checkpoint(model_path)  # before any weight loads
        self.model_path = model_path
        self.precision = precision
        self.micro_batch_size = micro_batch_size
        self.score_key = score_key
        self.max_length = max_length
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"no usable tokenizer in {model_path} ({exc}); a reward model reads text through its "
                             f"own tokenizer: save it next to the weights") from None
        self.policy_tokenizer = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path is not None else None
        self.retokenize = self.policy_tokenizer is not None and not same_vocabulary(self.policy_tokenizer, self.tokenizer)
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"the tokenizer in {model_path} has neither a pad nor an EOS token to pad "
                                 f"micro-batches with; set tokenizer.pad_token and save it")
            self.tokenizer.pad_token = self.tokenizer.eos_token

        model, info = AutoModelForSequenceClassification.from_pretrained(
            model_path, dtype=PRECISIONS[precision], output_loading_info=True)
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            raise ValueError(f"{model_path} lacks weights the sequence classifier needs (they would be random): "
                             f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if model.config.pad_token_id is None:  # decoder heads pool on the last non-pad token: they need the id
            model.config.pad_token_id = self.tokenizer.pad_token_id
        model.requires_grad_(False)
        self.model = model.to(self.device).eval()
        self._inputs = set(inspect.signature(self.model.forward).parameters)
        self._vocab_rows = self.model.get_input_embeddings().num_embeddings

    @property
    def token_limit(self) -> int | None:
        """Tokens per scored sequence at most: ``max_length``, else a real ``model_max_length``, else None."""
        if self.max_length is not None:
            return self.max_length
        limit = getattr(self.tokenizer, "model_max_length", None)
        return limit if isinstance(limit, int) and limit < _NO_LIMIT else None

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``<score_key>`` [B] fp32 and ``token_level_scores`` [B, R] fp32 (the score on the last valid response token).

        Reads ``prompts`` [B, P] (left-padded), ``responses`` [B, R], ``attention_mask`` [B, P+R] and
        ``response_mask`` [B, R]. A row's text is every attended prompt and response token, observation
        tokens of a multi-turn response included (attention 1, response mask 0); a row without a valid
        response token still gets its score but carries it on no token.
        """
        missing = [key for key in REQUIRED_KEYS if key not in data.batch]
        if missing:
            raise KeyError(f"compute_rm_score needs batch tensors {list(REQUIRED_KEYS)}; missing {missing}")
        prompts, responses = data.batch["prompts"], data.batch["responses"]
        attention = data.batch["attention_mask"].bool()
        prompt_keep, response_keep = attention[:, : prompts.shape[1]], attention[:, prompts.shape[1]:]
        if self.retokenize:
            encodings = self._encode_texts(self._decode(prompts, prompt_keep), self._decode(responses, response_keep))
        else:
            encodings = self._own_ids(prompts, prompt_keep, responses, response_keep)

        scores = torch.empty(len(data), dtype=torch.float32)
        for start in range(0, len(encodings), self.micro_batch_size):
            chunk = encodings[start: start + self.micro_batch_size]
            scores[start: start + len(chunk)] = self._score(chunk)
        token_level = last_token_scores(scores, data.batch["response_mask"])
        return DataProto({"token_level_scores": token_level, self.score_key: scores})

    # ------------------------------------------------------------ internals
    def _decode(self, tokens: torch.Tensor, keep: torch.Tensor) -> list[str]:
        rows = [row[k].tolist() for row, k in zip(tokens, keep)]
        return self.policy_tokenizer.batch_decode(rows, skip_special_tokens=True)

    def _encode_texts(self, prompts: list[str], responses: list[str]) -> list[dict[str, list[int]]]:
        """The reward tokenizer's encoding of each (prompt, response): chat template, else a text pair."""
        limit = self.token_limit
        truncation = {"truncation": limit is not None, "max_length": limit}
        if getattr(self.tokenizer, "chat_template", None):
            texts = [self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False)
                for p, r in zip(prompts, responses)]
            encoded = self.tokenizer(texts, add_special_tokens=False, **truncation)
        else:  # (in list form an empty response is still a pair: "[CLS] prompt [SEP] [SEP]" for BERT-style pairs)
            encoded = self.tokenizer(prompts, responses, **truncation)
        return [{key: encoded[key][i] for key in encoded.keys()} for i in range(len(prompts))]

    def _own_ids(self, prompts, prompt_keep, responses, response_keep) -> list[dict[str, list[int]]]:
        """Each row's attended prompt ids then attended response ids, truncated to ``token_limit``."""
        limit, rows = self.token_limit, []
        offset = self.rank * len(prompts)  # DP_COMPUTE_PROTO hands every rank an equal chunk
        for i in range(len(prompts)):
            ids = torch.cat([prompts[i][prompt_keep[i]], responses[i][response_keep[i]]]).tolist()
            if not ids:
                raise ValueError(f"row {offset + i} has no attended prompt or response token to score")
            if max(ids) >= self._vocab_rows or min(ids) < 0:
                bad = max(ids) if max(ids) >= self._vocab_rows else min(ids)
                raise ValueError(
                    f"row {offset + i} holds token id {bad}, outside the reward model's vocabulary of "
                    f"{self._vocab_rows} ids ({self.model_path}); pass tokenizer_path=<the policy's tokenizer> so "
                    f"the text is re-tokenized for the reward model")
            if limit is not None and len(ids) > limit:
                ids = ids[-limit:] if self.tokenizer.truncation_side == "left" else ids[:limit]
            rows.append({"input_ids": ids})
        return rows

    def _score(self, chunk: list[dict[str, list[int]]]) -> torch.Tensor:
        """logits[:, 0] of one micro-batch, padded on the side the reward tokenizer pads, as fp32 on the CPU."""
        batch = self.tokenizer.pad(chunk, padding=True, return_tensors="pt")
        inputs = {key: value.to(self.device) for key, value in batch.items() if key in self._inputs}
        with torch.no_grad():
            logits = self.model(**inputs).logits
        return logits[:, 0].float().cpu()
