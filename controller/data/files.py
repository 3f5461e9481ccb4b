"""Prompt files read with HF ``datasets``: parquet, JSON / JSONL, and ``save_to_disk`` directories.

Nothing is fetched from the hub: the builders are the packaged ``parquet``
and ``json`` ones on local paths, with the hub switched off so a typo in a
path cannot turn into a download attempt. ``datasets`` writes its Arrow
cache under ``cache_dir`` (a temporary directory by default, removed once
the rows are in memory).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.data.dataset import PromptDataset, RowKeys, rows_to_dataset

__all__ = ["FILE_FORMATS", "hf_datasets", "load_jsonl_prompts", "load_prompt_files", "read_rows"]

FILE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


def hf_datasets():
    """The ``datasets`` module, with the hub off."""
    # Set before the first import: datasets reads these once, when it loads its config.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.config.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    return datasets


def _read_saved(datasets, path: Path) -> list[dict[str, Any]]:
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.DatasetDict):
        splits = sorted(saved)
        raise ValueError(f"{path} is a DatasetDict with splits {splits}; name one split's directory, "
                         f"e.g. {path / splits[0]}")
    return saved.to_list()


def read_rows(path: str | Path, cache_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Every row of one file or ``save_to_disk`` directory, as plain dicts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    datasets = hf_datasets()
    if path.is_dir():
        if not (path / "dataset_info.json").is_file() and not (path / "dataset_dict.json").is_file():
            raise ValueError(f"{path} is a directory but not one written by datasets' save_to_disk "
                             f"(no dataset_info.json or dataset_dict.json in it)")
        return _read_saved(datasets, path)
    builder = FILE_FORMATS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"prompt file {path}: unsupported format {path.suffix!r}; accepted: "
                         f"{sorted(FILE_FORMATS)} files or a datasets save_to_disk directory")
    with contextlib.ExitStack() as stack:
        if cache_dir is None:
            cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="hybridflow-datasets-"))
        try:
            loaded = datasets.load_dataset(builder, data_files=[str(path)], split="train", cache_dir=str(cache_dir))
        except Exception as exc:  # datasets raises many kinds (Arrow, JSON, schema); the file is what matters
            raise ValueError(f"prompt file {path} could not be read as {builder} "
                             f"({type(exc).__name__}: {str(exc)[:300]})") from exc
        return loaded.to_list()


def load_prompt_files(paths: str | Path | Sequence[str | Path], keys: RowKeys = RowKeys(),
                      cache_dir: str | Path | None = None) -> PromptDataset:
    """One dataset from one path or several (concatenated in order), verl's row schema."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ValueError("no prompt files given")
    return PromptDataset.concat([rows_to_dataset(read_rows(p, cache_dir), keys, source=str(p)) for p in paths])


def load_jsonl_prompts(path: str | Path, prompt_key: str = "prompt", answer_key: str | None = None) -> PromptDataset:
    """One file's prompts (any accepted format, despite the name: kept for existing callers)."""
    return load_prompt_files([path], RowKeys(prompt=prompt_key, answer=answer_key))
