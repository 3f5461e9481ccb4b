"""Training checkpoints of the megatron engine: written atomically, loadable at any TP/PP.

Layout of a checkpoint root:

    root/latest                 the name of the newest complete checkpoint
    root/step_00000012/         model + optimizer (megatron dist-checkpointing: every
                                rank writes its shards; loading reshards to the new layout)
    root/step_00000012/extra.pt scheduler, counters, layout (rank 0)
    root/step_00000012/rng/     each rank's RNG states (restored when the layout matches)

All ranks write into ``.step_00000012.tmp``; after a barrier rank 0 renames it
into place and then replaces ``latest``, so a crash mid-save leaves the
previous checkpoint and ``latest`` untouched.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointNotFound"]

LATEST = "latest"


class CheckpointNotFound(FileNotFoundError):
    pass


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(engine, is_loading: bool) -> dict[str, Any]:
    model_state = engine.module().sharded_state_dict()
    state = {"model": model_state}
    if engine.optimizer is not None:
        if engine.optim_config.use_distributed_optimizer:
            # megatron-core 0.16.1 without apex / transformer-engine reads an
            # empty state from its distributed optimizer here and asserts.
            raise NotImplementedError(
                "checkpoints of the distributed optimizer are not supported yet; "
                "train with use_distributed_optimizer=False to save and resume"
            )
        state["optimizer"] = engine.optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    return state


def save_checkpoint(engine, root: str | Path, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Collective: save the engine's state as ``root/step_<step>``; returns that path."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)  # empty: megatron takes a non-empty directory for an interrupted save
    dist.barrier()
    dist_checkpointing.save(_sharded_state(engine, is_loading=False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        torch.save(
            {
                "step": step,
                "layout": str(engine.layout),
                "scheduler": engine.scheduler.state_dict() if engine.scheduler else None,
                "extra": extra or {},
            },
            tmp / "extra.pt",
        )
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / LATEST)
    dist.barrier()
    return final


def latest_checkpoint(root: str | Path) -> Path:
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        raise CheckpointNotFound(f"no checkpoint in {root}: {pointer} does not exist")
    path = root / pointer.read_text().strip()
    if not (path / "extra.pt").is_file():
        raise CheckpointNotFound(f"{pointer} names {path.name}, which is missing or incomplete")
    return path


def load_checkpoint(engine, path: str | Path) -> dict[str, Any]:
    """Collective: restore the engine from a checkpoint directory (or a root with ``latest``).

    Returns the saved ``extra`` dict plus the saved step. RNG states are
    restored only when the checkpoint was written at the same layout.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    if (path / LATEST).is_file():
        path = latest_checkpoint(path)
    if not (path / "extra.pt").is_file():
        raise CheckpointNotFound(f"{path} is not a complete checkpoint (no extra.pt)")
    meta = torch.load(path / "extra.pt", weights_only=False)
    state = dist_checkpointing.load(_sharded_state(engine, is_loading=True), str(path))
    engine.module().load_state_dict(state["model"])
    if engine.optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointNotFound(f"{path} holds no optimizer state; it was saved by a role without one")
        engine.optimizer.load_state_dict(state["optimizer"])
        if meta["scheduler"] is not None:
            engine.scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if meta["layout"] == str(engine.layout) and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return {"step": meta["step"], **meta["extra"]}
