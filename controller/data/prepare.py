"""The job's prompts from its ``data`` config: loaded, rendered, tokenized and length-checked.

``hybridflow train`` calls this before torchrun or Ray starts a process, so a
missing column, a chat prompt without a template or an overlong prompt is an
exit code and a message, not a worker traceback at the first generation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controller.data.arithmetic import arithmetic_prompts, word_problems
from controller.data.code_expression import code_expression_prompts
from controller.data.chat_template import PromptFormat, encode_prompts
from controller.data.dataset import PromptDataset, RowKeys
from controller.data.files import load_prompt_files
from controller.data.images import ImageProcessing
from controller.data.overlong import drop_or_refuse_overlong

if TYPE_CHECKING:
    from controller.config import DataConfig

__all__ = ["JobPrompts", "load_job_prompts", "prompt_format", "raw_job_prompts"]


@dataclass(frozen=True)
class JobPrompts:
    train: PromptDataset
    val: PromptDataset | None


def prompt_format(data: DataConfig) -> PromptFormat:
    """The ``data`` config's chat-template settings."""
    return PromptFormat(data.apply_chat_template, data.chat_wrap, data.system_prompt)


def raw_job_prompts(data: DataConfig) -> JobPrompts:
    """The prompts as read (not yet tokenized): a built-in generator, or the files."""
    if data.task == "arithmetic":
        val = arithmetic_prompts(data.val_size, data.seed + 1, data.max_operand, data.operators) if data.val_size else None
        return JobPrompts(arithmetic_prompts(data.train_size, data.seed, data.max_operand, data.operators), val)
    if data.task == "word_problems":
        def problems(count: int, seed: int) -> PromptDataset:
            return word_problems(count, seed, data.steps, data.max_operand, data.operators)

        return JobPrompts(problems(data.train_size, data.seed), problems(data.val_size, data.seed + 1) if data.val_size else None)
    if data.task == "code_expression":
        def targets(count: int, seed: int) -> PromptDataset:
            return code_expression_prompts(count, seed, data.max_operand, data.operators)

        return JobPrompts(targets(data.train_size, data.seed), targets(data.val_size, data.seed + 1) if data.val_size else None)
    keys = RowKeys(data.prompt_key, data.answer_key, data.data_source_key, data.extra_info_key, data.image_key)
    val = load_prompt_files(data.val_paths, keys, data.cache_dir) if data.val_paths else None
    return JobPrompts(load_prompt_files(data.train_paths, keys, data.cache_dir), val)


def load_job_prompts(data: DataConfig, tokenizer: Any, max_prompt_length: int, truncation: str = "error",
                     log: Callable[[str], None] | None = None, images: ImageProcessing | None = None) -> JobPrompts:
    """Encoded train / val prompts, overlong ones dropped (``data.filter_overlong_prompts``) or refused.

    With ``rollout.truncation: left`` the rollout keeps a long prompt's end,
    so long prompts pass unless the filter drops them.
    """
    log = log or (lambda line: print(line, file=sys.stderr))
    raw = raw_job_prompts(data)
    fmt = prompt_format(data)
    out = []
    for name, dataset in (("training", raw.train), ("validation", raw.val)):
        if dataset is None:
            out.append(None)
            continue
        dataset = encode_prompts(dataset, tokenizer, fmt, name=name, images=images)
        if data.filter_overlong_prompts or truncation == "error":
            dataset = drop_or_refuse_overlong(dataset, max_prompt_length, data.filter_overlong_prompts, name, log)
        out.append(dataset)
    train, val = out
    if len(train) < data.batch_size:
        raise ValueError(f"data.batch_size {data.batch_size} is larger than the {len(train)} training prompts"
                         + (" left after dropping overlong ones" if data.filter_overlong_prompts else ""))
    return JobPrompts(train, val)
