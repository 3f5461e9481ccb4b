"""Ready-to-train parquet files in verl's schema (``hybridflow data``): the arithmetic task, GSM8K, and rows with
images (each image checked and stored in the file, as datasets' Image feature).

Each file is written with ``datasets`` (``Dataset.from_list(...).to_parquet``),
so what ``data.train_files`` reads back is exactly what was written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.data.arithmetic import ARITHMETIC_INSTRUCTION, ARITHMETIC_OPERATORS, arithmetic_rows
from controller.data.files import hf_datasets, read_rows
from controller.data.gsm8k import GSM8K_INSTRUCTION, gsm8k_rows
from controller.data.images import IMAGE_PLACEHOLDER, row_images

__all__ = ["write_arithmetic_files", "write_gsm8k_file", "write_image_rows", "write_parquet"]


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


def write_image_rows(input_path: str | Path, out: str | Path, split: str = "train", image_key: str = "images",
                     prompt_key: str = "prompt") -> Path:
    """Rows with images (paths, ``{"bytes": ...}`` / ``{"path": ...}``) from ``input_path`` as ``out/<split>.parquet``,
    each image read, checked and stored in the file (PNG) under ``image_key`` as datasets' Image feature; a row's
    ``<image>`` placeholders must match its images. A bad row is refused with its index; nothing is written."""
    import io

    datasets = hf_datasets()
    rows = read_rows(input_path)
    out_rows = []
    for number, row in enumerate(rows):
        where = f"{input_path} row {number}"
        images = row_images(row, image_key, where)
        if images is None:
            raise ValueError(f"{where} has no {image_key!r} column (the images); columns: {sorted(row)}")
        prompt = row.get(prompt_key)
        text = prompt if isinstance(prompt, str) else " ".join(m.get("content") or "" for m in prompt or [])
        if text.count(IMAGE_PLACEHOLDER) != len(images):
            raise ValueError(f"{where}: the prompt holds {text.count(IMAGE_PLACEHOLDER)} {IMAGE_PLACEHOLDER} "
                             f"placeholder(s) for its {len(images)} image(s)")
        stored = []
        for image in images:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            stored.append({"bytes": buffer.getvalue(), "path": None})
        out_rows.append({**row, image_key: stored})
    path = Path(out) / f"{split}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    dataset = datasets.Dataset.from_list(out_rows)
    dataset.cast_column(image_key, datasets.Sequence(datasets.Image())).to_parquet(str(path))
    return path
