"""Prompts longer than the rollout accepts, found when the data loads rather than at generation.

``rollout.max_prompt_length`` bounds the prompt a rollout engine takes;
finding an overlong prompt only when it is sampled costs a launch and a
traceback from inside a worker. Here it is either dropped (``data.filter_overlong_prompts``)
or named with its length before any process starts.
"""

from __future__ import annotations

from collections.abc import Callable

from controller.data.dataset import PromptDataset

__all__ = ["OverlongPromptError", "drop_or_refuse_overlong", "overlong_rows"]

_SHOWN = 5  # rows named in the error


class OverlongPromptError(ValueError):
    """Prompts longer than rollout.max_prompt_length, with the filter off."""


def overlong_rows(dataset: PromptDataset, max_prompt_length: int) -> list[int]:
    if dataset.input_ids is None:
        raise ValueError("encode the prompts (encode_prompts) before measuring them")
    return [i for i, ids in enumerate(dataset.input_ids) if len(ids) > max_prompt_length]


def drop_or_refuse_overlong(dataset: PromptDataset, max_prompt_length: int, filter_overlong: bool,
                            name: str = "training", log: Callable[[str], None] = print) -> PromptDataset:
    """``dataset`` without its overlong rows (logging how many), or OverlongPromptError naming the first ones."""
    rows = overlong_rows(dataset, max_prompt_length)
    if not rows:
        return dataset
    if filter_overlong:
        if len(rows) == len(dataset):
            raise OverlongPromptError(f"every one of the {len(dataset)} {name} prompts is longer than "
                                      f"rollout.max_prompt_length={max_prompt_length} tokens; nothing is left to train on")
        log(f"[hybridflow] data: dropped {len(rows)} of {len(dataset)} {name} prompts longer than "
            f"rollout.max_prompt_length={max_prompt_length} tokens (data.filter_overlong_prompts)")
        dropped = set(rows)
        return dataset.select([i for i in range(len(dataset)) if i not in dropped])
    assert dataset.input_ids is not None and dataset.prompt_texts is not None
    shown = ", ".join(f"row {i} ({len(dataset.input_ids[i])} tokens: {dataset.prompt_texts[i][:40]!r}...)"
                      for i in rows[:_SHOWN])
    more = f" and {len(rows) - _SHOWN} more" if len(rows) > _SHOWN else ""
    raise OverlongPromptError(
        f"{len(rows)} of {len(dataset)} {name} prompts are longer than rollout.max_prompt_length="
        f"{max_prompt_length} tokens: {shown}{more}. Set data.filter_overlong_prompts=true to drop them, "
        f"or raise rollout.max_prompt_length")
