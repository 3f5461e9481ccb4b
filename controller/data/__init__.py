"""Prompts for training and validation: files in verl's schema or the built-in arithmetic task,
rendered through the tokenizer's chat template, checked for length, and batched by a
dataloader that can resume mid-epoch.

- ``dataset``: ``PromptDataset`` and verl's row schema;
- ``files``: parquet / JSON(L) / ``save_to_disk`` directories through HF ``datasets``;
- ``chat_template``: prompts into the token ids the rollout sees;
- ``overlong``: prompts over ``rollout.max_prompt_length``, dropped or refused;
- ``loader``: ``PromptLoader``, batches as DataProtos;
- ``arithmetic`` / ``gsm8k``: the built-in generator and the GSM8K converter;
- ``prepare``: a job's ``data`` config into checked datasets, before launch.
"""

from controller.data.arithmetic import arithmetic_prompts, arithmetic_rows
from controller.data.chat_template import PromptFormat, encode_prompts
from controller.data.dataset import PromptDataset, RowKeys, rows_to_dataset
from controller.data.files import load_jsonl_prompts, load_prompt_files
from controller.data.gsm8k import gsm8k_rows
from controller.data.loader import PromptLoader
from controller.data.overlong import OverlongPromptError, drop_or_refuse_overlong

__all__ = [
    "OverlongPromptError", "PromptDataset", "PromptFormat", "PromptLoader", "RowKeys", "arithmetic_prompts",
    "arithmetic_rows", "drop_or_refuse_overlong", "encode_prompts", "gsm8k_rows", "load_jsonl_prompts",
    "load_prompt_files", "rows_to_dataset",
]
