"""Prompt rows in verl's schema, so the files people already have work unchanged.

A row is::

    {"prompt": "7+5=" | [{"role": "user", "content": "..."}, ...],
     "data_source": "openai/gsm8k",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {...any dict, handed to reward functions...}}

A plain ``ground_truth`` column works in place of ``reward_model``; every key
can be renamed (``data.prompt_key``, ``data.answer_key``, ...). A vision-language
row adds its images (``images``, ``data.image_key``) and puts an ``<image>``
placeholder in its prompt where each goes (``controller.data.images``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from controller.data.images import row_images

__all__ = ["Prompt", "PromptDataset", "RowKeys", "lookup_key", "rows_to_dataset"]

# A prompt is text, or a chat: a list of {"role": ..., "content": ...} messages.
Prompt = str | list[dict[str, Any]]


@dataclass(frozen=True)
class PromptDataset:
    """Prompts with their ground truths, data sources and extra info, row for row.

    ``input_ids`` / ``prompt_texts`` are set once the prompts are rendered
    and tokenized (``encode_prompts``): what the rollout sees, exactly.
    """

    prompts: tuple[Prompt, ...]
    answers: tuple[Any, ...]
    data_sources: tuple[str | None, ...] = ()
    extra_infos: tuple[dict[str, Any], ...] = ()
    input_ids: tuple[tuple[int, ...], ...] | None = None
    prompt_texts: tuple[str, ...] | None = None
    chats: tuple[tuple[dict[str, Any], ...] | None, ...] | None = None  # the messages rendered (None: plain text)
    # a vision-language dataset: each row's images (PIL, decoded; () for none), where its <image>s go
    images: tuple[tuple[Any, ...], ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompts)
        # Datasets built by hand (PromptDataset(prompts, answers)) get no source and empty extra info.
        if not self.data_sources:
            object.__setattr__(self, "data_sources", (None,) * n)
        if not self.extra_infos:
            object.__setattr__(self, "extra_infos", tuple({} for _ in range(n)))
        for name in ("answers", "data_sources", "extra_infos", "input_ids", "prompt_texts", "chats", "images"):
            column = getattr(self, name)
            if column is not None and len(column) != n:
                raise ValueError(f"PromptDataset: {name} has {len(column)} rows, prompts has {n}")

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, rows: Sequence[int]) -> PromptDataset:
        """The given rows, in that order (every column, the encoded ones too)."""
        def pick(column):
            return None if column is None else tuple(column[i] for i in rows)

        return PromptDataset(pick(self.prompts), pick(self.answers), pick(self.data_sources), pick(self.extra_infos),
                             pick(self.input_ids), pick(self.prompt_texts), pick(self.chats), pick(self.images))

    def with_encoding(self, input_ids: Sequence[Sequence[int]], prompt_texts: Sequence[str],
                      chats: Sequence[Sequence[dict[str, Any]] | None] | None = None) -> PromptDataset:
        return replace(self, input_ids=tuple(tuple(ids) for ids in input_ids), prompt_texts=tuple(prompt_texts),
                       chats=None if chats is None else tuple(None if c is None else tuple(c) for c in chats))

    @staticmethod
    def concat(parts: Sequence[PromptDataset]) -> PromptDataset:
        if any(p.input_ids is not None for p in parts):
            raise ValueError("concatenate datasets before encoding them")
        images = None
        if any(p.images is not None for p in parts):
            images = tuple(row for p in parts for row in (p.images or ((),) * len(p)))
        return PromptDataset(*(tuple(row for p in parts for row in getattr(p, name))
                               for name in ("prompts", "answers", "data_sources", "extra_infos")), images=images)


@dataclass(frozen=True)
class RowKeys:
    """Where each field lives in a row; ``answer`` None: ``reward_model.ground_truth``, else ``ground_truth``."""

    prompt: str = "prompt"
    answer: str | None = None
    data_source: str = "data_source"
    extra_info: str = "extra_info"
    images: str = "images"  # a vision-language row's images (data.image_key)


def lookup_key(row: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """(found, value) for a key such as ``reward_model.ground_truth``."""
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _answer(row: dict[str, Any], key: str | None) -> Any:
    if key is not None:
        value = lookup_key(row, key)[1]
    else:
        found, value = lookup_key(row, "reward_model.ground_truth")
        if not found:
            value = row.get("ground_truth")
    # Numbers become text (reward functions compare text); lists (several valid answers) stay lists.
    return value if value is None or isinstance(value, (str, list)) else str(value)


def _prompt(row: dict[str, Any], key: str, where: str) -> Prompt:
    found, value = lookup_key(row, key)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        # Arrow fills keys that other rows' messages have with None; they are not part of this message.
        return [{k: v for k, v in m.items() if v is not None} for m in value]
    if not found:
        raise ValueError(f"{where} has no prompt column {key!r} (data.prompt_key); columns: {sorted(row)}")
    raise ValueError(f"{where}: {key!r} is {type(value).__name__} {str(value)[:80]!r}; expected a string or a "
                     f"non-empty list of {{'role': str, 'content': str}} messages")


def rows_to_dataset(rows: Iterable[dict[str, Any]], keys: RowKeys = RowKeys(), source: str = "data") -> PromptDataset:
    """A PromptDataset from verl-schema rows; errors name ``source`` and the row number."""
    prompts, answers, data_sources, extra_infos, images = [], [], [], [], []
    for number, row in enumerate(rows):
        where = f"{source} row {number}"
        prompts.append(_prompt(row, keys.prompt, where))
        images.append(row_images(row, keys.images, where))
        answers.append(_answer(row, keys.answer))
        data_source = lookup_key(row, keys.data_source)[1]
        if data_source is not None and not isinstance(data_source, str):
            raise ValueError(f"{where}: {keys.data_source!r} must be a string, got {data_source!r}")
        data_sources.append(data_source)
        extra = lookup_key(row, keys.extra_info)[1]
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"{where}: {keys.extra_info!r} must be a mapping, got {type(extra).__name__} {extra!r}")
        extra_infos.append(dict(extra or {}))
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    with_images = None if all(i is None for i in images) else tuple(i or () for i in images)
    return PromptDataset(tuple(prompts), tuple(answers), tuple(data_sources), tuple(extra_infos), images=with_images)
