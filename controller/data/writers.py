"""Ready-to-train parquet files in verl's schema (``hybridflow data``): the arithmetic task, GSM8K.

Each file is written with ``datasets`` (``Dataset.from_list(...).to_parquet``),
so what ``data.train_files`` reads back is exactly what was written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.data.arithmetic import ARITHMETIC_INSTRUCTION, ARITHMETIC_OPERATORS, arithmetic_rows
from controller.data.files import hf_datasets, read_rows
from controller.data.gsm8k import GSM8K_INSTRUCTION, gsm8k_rows

__all__ = ["write_arithmetic_files", "write_gsm8k_file", "write_parquet"]


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hf_datasets().Dataset.from_list(rows).to_parquet(str(path))
    return path


def write_arithmetic_files(out: str | Path, train_size: int = 2048, val_size: int = 64, seed: int = 0,
                           max_operand: int = 9, operators: str = ARITHMETIC_OPERATORS,
                           instruction: str = ARITHMETIC_INSTRUCTION) -> list[Path]:
    """``out/train.parquet`` and (with ``val_size``) ``out/val.parquet``, chat prompts; the splits use different seeds."""
    out = Path(out)
    paths = [write_parquet(arithmetic_rows(train_size, seed, "train", max_operand, operators, instruction),
                           out / "train.parquet")]
    if val_size:
        paths.append(write_parquet(arithmetic_rows(val_size, seed + 1, "val", max_operand, operators, instruction),
                                   out / "val.parquet"))
    return paths


def write_gsm8k_file(input_path: str | Path, out: str | Path, split: str = "train",
                     instruction: str = GSM8K_INSTRUCTION) -> Path:
    """GSM8K rows from ``input_path`` (parquet / JSON(L) / save_to_disk dir) as ``out/<split>.parquet``."""
    rows = gsm8k_rows(read_rows(input_path), split, instruction, source=str(input_path))
    return write_parquet(rows, Path(out) / f"{split}.parquet")
