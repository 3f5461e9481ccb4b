"""Prompts into the token ids the rollout sees: chats through the tokenizer's chat template.

A message list is rendered by ``tokenizer.apply_chat_template(...,
add_generation_prompt=True)`` and its text tokenized with no special tokens
added, as ``apply_chat_template(tokenize=True)`` does: adding them would put a
second BOS in front on tokenizers whose template already writes it. A string
prompt is tokenized as is, without special tokens, unless
``chat_wrap`` makes it a user message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.data.dataset import Prompt, PromptDataset
from controller.data.images import IMAGE_PLACEHOLDER, ImageProcessing

__all__ = ["PromptFormat", "apply_chat_template_problem", "encode_prompts", "render_prompt", "uses_chat_template",
           "with_placeholders"]


@dataclass(frozen=True)
class PromptFormat:
    """How prompts become text (the ``data.apply_chat_template`` / ``chat_wrap`` / ``system_prompt`` keys)."""

    apply_chat_template: bool | str = "auto"  # "auto": when the tokenizer has a template
    chat_wrap: bool = False  # a string prompt becomes [{"role": "user", "content": prompt}]
    system_prompt: str | None = None  # prepended as a system message unless the chat starts with one

    def __post_init__(self) -> None:
        problem = apply_chat_template_problem(self.apply_chat_template)
        if problem:
            raise ValueError(problem)


def apply_chat_template_problem(value: Any) -> str | None:
    """Why ``value`` cannot be ``data.apply_chat_template`` (RL's and SFT's data sections); None when it can."""
    if not isinstance(value, bool) and value != "auto":
        return f"data.apply_chat_template must be true, false or 'auto', got {value!r}"
    return None


def uses_chat_template(fmt: PromptFormat, tokenizer: Any) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if fmt.apply_chat_template == "auto":
        return has_template
    if fmt.apply_chat_template and not has_template:
        raise ValueError(f"data.apply_chat_template is true but the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) "
                         f"has no chat template; set data.apply_chat_template=false or auto, or use a chat model's tokenizer")
    return bool(fmt.apply_chat_template)


def _chat(prompt: Prompt, fmt: PromptFormat) -> list[dict[str, Any]] | None:
    """The messages to render, or None when the prompt stays plain text."""
    if isinstance(prompt, str):
        if not fmt.chat_wrap:
            return None
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
    if fmt.system_prompt is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": fmt.system_prompt}, *messages]
    return messages


def render_prompt(prompt: Prompt, tokenizer: Any, fmt: PromptFormat, chat: bool, where: str = "prompt") -> tuple[list[int], str]:
    """(token ids, the text they spell) of one prompt; ``chat`` from ``uses_chat_template``."""
    messages = _chat(prompt, fmt)
    if messages is None:
        if fmt.system_prompt is not None:
            raise ValueError(f"{where} is a string and data.system_prompt is set: a system prompt needs a chat; "
                             f"set data.chat_wrap=true to make string prompts user messages")
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"]), prompt
    if not chat:
        why = "data.chat_wrap is true" if isinstance(prompt, str) else "it is a list of chat messages"
        raise ValueError(f"{where}: {why}, but the chat template is off (data.apply_chat_template="
                         f"{fmt.apply_chat_template!r}; the tokenizer has "
                         f"{'a' if getattr(tokenizer, 'chat_template', None) else 'no'} chat template)")
    # What apply_chat_template(tokenize=True) does, rendering once: the text, then its tokens with no
    # special tokens added (the template writes its own).
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text


def encode_prompts(dataset: PromptDataset, tokenizer: Any, fmt: PromptFormat = PromptFormat(),
                   name: str = "data", images: ImageProcessing | None = None) -> PromptDataset:
    """``dataset`` with ``input_ids`` and ``prompt_texts`` filled in (already encoded: returned as is). A dataset
    with images needs the model's ``images`` processing: each ``<image>`` becomes the image's run of tokens."""
    if dataset.input_ids is not None:
        return dataset
    prompts = dataset.prompts
    if dataset.images is not None and any(dataset.images):
        if images is None:
            raise ValueError(f"the {name} data has images (its images column), but the model is text only; "
                             "train a vision-language model (Qwen2.5-VL) or drop the column")
        prompts = tuple(with_placeholders(p, images, len(dataset.images[i]), f"{name} row {i}")
                        for i, p in enumerate(prompts))
    chat = uses_chat_template(fmt, tokenizer)
    encoded = [render_prompt(p, tokenizer, fmt, chat, where=f"{name} row {i}") for i, p in enumerate(prompts)]
    chats = [_chat(p, fmt) if chat else None for p in prompts]  # what a multi-turn rollout re-renders
    ids = [ids for ids, _ in encoded]
    if dataset.images is not None and images is not None:
        ids = [images.expand(row, dataset.images[i], f"{name} row {i}") for i, row in enumerate(ids)]
    return dataset.with_encoding(ids, [text for _, text in encoded], chats)


def with_placeholders(prompt: Prompt, images: ImageProcessing, count: int, where: str) -> Prompt:
    """``prompt`` with its ``<image>`` placeholders (``count`` of them, over its messages) as vision tokens."""
    if isinstance(prompt, str):
        return images.placeholders(prompt, count, where)
    found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in prompt)
    if found != count:
        raise ValueError(f"{where}: the prompt's messages hold {found} {IMAGE_PLACEHOLDER} placeholder(s) for its "
                         f"{count} image(s); put one where each image goes")
    return [{**m, "content": images.placeholders(m["content"], m["content"].count(IMAGE_PLACEHOLDER), where)}
            for m in prompt]
