"""Supervised examples as token ids with a loss mask: prompt/response pairs, chat message lists, plain text.

An example is split where the model's first learned token starts: ``prompt_ids`` are context only, and
``response_ids`` carry a 0/1 ``loss_mask`` (a training row's ``response_mask``), so an SFT batch has the
same layout as a rollout's and trains through the same engine.

* **Pair** (``prompt``, ``response``): the prompt rendered as a rollout renders it (the chat template
  when one applies, ``controller.data.chat_template.render_prompt``); the response's ids and then EOS,
  all learned.
* **Messages** (a chat): the loss falls on the assistant turns only. Each assistant turn's ids are the
  difference between the template's rendering of the conversation through that turn and its rendering
  of the conversation before it with the generation prompt; what the template writes after the turn's
  end-of-turn token (a newline in ChatML) is not learned, nor is any other role's turn. A template whose
  longer renderings do not start with the shorter ones' ids is refused (its turns cannot be cut out).
* **Text**: the first token is the context, every later token and EOS is learned.

A pair's prompt or a chat's user turns may hold images (``<image>`` placeholders, the row's images in
order): each becomes its full run of image tokens (``controller.data.images``), context, never learned,
and the example keeps its images for the batch (``with_images``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from controller.data.chat_template import PromptFormat, render_prompt

__all__ = ["SFTExample", "encode_pair", "encode_messages", "encode_text", "with_images", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The chat template cannot be cut into turns as ids (named, with what it rendered)."""


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # one per response id: 1 learned, 0 context
    images: tuple = ()  # a vision-language example's images (PIL), in the order of its image-token runs

    def __post_init__(self) -> None:
        if len(self.loss_mask) != len(self.response_ids):
            raise ValueError(f"{len(self.loss_mask)} loss-mask entries for {len(self.response_ids)} response ids")
        if not self.prompt_ids:
            raise ValueError("an SFT example needs at least one prompt token (the first learned token is predicted "
                             "from it)")

    @property
    def learned(self) -> int:
        return sum(self.loss_mask)


def _eos(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no EOS token: a learned "
                         "response needs one to end on")
    return int(tokenizer.eos_token_id)


def encode_pair(prompt, response: str, tokenizer, fmt: PromptFormat = PromptFormat(), chat: bool = False,
                where: str = "example") -> SFTExample:
    """A prompt (string or messages, rendered as the rollout renders it) and a response string."""
    if not isinstance(response, str):
        raise ValueError(f"{where}: the response must be a string, got {type(response).__name__}")
    prompt_ids, _ = render_prompt(prompt, tokenizer, fmt, chat, where)
    response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [_eos(tokenizer)]
    return SFTExample(prompt_ids, response_ids, [1] * len(response_ids))


def encode_text(text: str, tokenizer, where: str = "example") -> SFTExample:
    """Plain text: every token but the first, and EOS, learned."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"{where}: the text is empty")
    rest = ids[1:] + [_eos(tokenizer)]
    return SFTExample(ids[:1], rest, [1] * len(rest))


def _render(tokenizer, messages: Sequence[dict], generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
    ids = tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=generation_prompt,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_messages(messages: Sequence[dict[str, Any]], tokenizer, where: str = "example",
                    tools: list[dict] | None = None) -> SFTExample:
    """A chat; the assistant turns are learned (through their end-of-turn token), nothing else. ``tools``
    (OpenAI function specs) go to the chat template, as the rollout gives them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where} is a list of chat messages, but the tokenizer "
                         f"{getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
    roles = [m.get("role") for m in messages]
    turns = [k for k, role in enumerate(roles) if role == "assistant"]
    if not turns:
        raise ValueError(f"{where}: no assistant message to learn from (roles: {roles})")
    if turns[0] == 0:
        raise ValueError(f"{where}: the conversation starts with an assistant turn; it needs a prompt before it")
    eos = _eos(tokenizer)
    full = _render(tokenizer, messages, generation_prompt=False, tools=tools)
    mask = [0] * len(full)
    first = None
    for k in turns:
        before = _render(tokenizer, messages[:k], generation_prompt=True, tools=tools)
        through = _render(tokenizer, messages[: k + 1], generation_prompt=False, tools=tools)
        for shorter, longer in ((before, through), (through, full)):
            if longer[: len(shorter)] != shorter:
                raise ChatTemplateError(
                    f"{where}: the chat template renders a longer conversation so that it does not start with the "
                    f"shorter one's ids, so assistant turns cannot be cut out: {tokenizer.decode(shorter)!r} vs "
                    f"{tokenizer.decode(longer)!r}")
        turn = through[len(before):]
        learned = turn.index(eos) + 1 if eos in turn else len(turn)  # after end-of-turn: template framing
        for i in range(len(before), len(before) + learned):
            mask[i] = 1
        first = len(before) if first is None else first
    return SFTExample(full[:first], full[first:], mask[first:])


def with_images(example: SFTExample, images: Sequence, processing, where: str) -> SFTExample:
    """``example`` (rendered with one image token per image) with each image's full run of image tokens, wherever
    its turn falls; the runs are context (not learned)."""
    pad = processing.vision.image_token_id
    count = sum(1 for t in example.prompt_ids + example.response_ids if t == pad)
    if count != len(images):
        raise ValueError(f"{where}: the rendered example holds {count} image tokens for {len(images)} image(s)")
    runs = iter([processing.tokens(image, where) for image in images])
    prompt = [t for token in example.prompt_ids for t in ([pad] * next(runs) if token == pad else [token])]
    response, mask = [], []
    for token, learned in zip(example.response_ids, example.loss_mask):
        n = next(runs) if token == pad else 1
        response += [token] * n
        mask += [0 if token == pad else learned] * n
    return SFTExample(prompt, response, mask, tuple(images))
