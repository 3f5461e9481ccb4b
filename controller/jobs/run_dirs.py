"""What a run directory holds, read back: the SFT run behind an RL job's starting checkpoint."""

from __future__ import annotations

from pathlib import Path

import yaml

__all__ = ["sft_run_of"]


def sft_run_of(model_path: str | Path) -> Path | None:
    """The SFT run directory whose HF export ``model_path`` is (``RUN/hf_actor`` beside the
    ``RUN/config.yaml`` and ``RUN/metrics.jsonl`` that ``hybridflow sft`` writes), else None."""
    path = Path(model_path)
    if path.name != "hf_actor" or not (path.parent / "metrics.jsonl").is_file():
        return None
    try:
        written = yaml.safe_load((path.parent / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return path.parent if isinstance(written, dict) and written.get("kind") == "sft" else None
