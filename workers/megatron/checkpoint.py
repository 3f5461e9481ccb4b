"""Training checkpoints of the megatron engine: written atomically, loadable at any TP/PP/DP.

Layout of a checkpoint root:

    root/latest                 the name of the newest complete checkpoint
    root/step_00000012/         model + optimizer (megatron dist-checkpointing: every
                                rank writes its shards; loading reshards to the new layout)
    root/step_00000012/extra.pt scheduler, counters, layout, optimizer kind and precision (rank 0)
    root/step_00000012/rng/     each rank's RNG states (restored when the layout matches)

The optimizer state is kept in model space, each tensor sharded as its
parameter: exp_avg / exp_avg_sq, and in bf16 the fp32 master weights; with
the distributed optimizer also in fp32 (its "param", a copy of the weights),
so a checkpoint saved at one DP size loads at another. A checkpoint loads
only into a job with the same ``use_distributed_optimizer`` and precision
(their optimizers store different states); a mismatch is refused by name.

All ranks write into ``.step_00000012.tmp``; after a barrier rank 0 renames it
into place and then replaces ``latest``, so a crash mid-save leaves the
previous checkpoint and ``latest`` untouched.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from workers.megatron.megatron_compat import fork_checkpoint_results_queue, synchronize_chained_steps

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


# The distributed optimizer's parameter state (fp32 master weights, exp_avg,
# exp_avg_sq) is written in model space: one tensor per parameter, sharded as
# the parameter is (TP / PP), so it loads at any TP, PP and DP size. In
# megatron-core 0.16.1 the format meant for that, "fully_sharded_model_space",
# no longer saves (its ShardedTensors use flattened_range, which dist-checkpointing
# now rejects); "fully_reshardable" is its replacement: on save each DP group
# gathers its shards (every DP rank then holds its TP / PP shard's whole state
# for a moment; DP rank 0 writes it), on load every rank reads its parameters'
# whole tensors and keeps its own DP slice.
DIST_OPT_SHARDING = "fully_reshardable"


def _uses_dist_opt(engine) -> bool:
    return engine.optim_config is not None and engine.optim_config.use_distributed_optimizer


def _megatron_optimizers(engine) -> list:
    optimizer = engine.optimizer
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _torch_adam(optimizer) -> bool:
    """The DistributedOptimizer wraps torch's Adam (no apex / transformer-engine FusedAdam)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer) and isinstance(optimizer.optimizer, (torch.optim.Adam, torch.optim.AdamW))


def _init_dist_opt_state(engine) -> None:
    """Give a torch Adam under the distributed optimizer its state before its first step.

    Without apex / transformer-engine, the DistributedOptimizer wraps torch's
    Adam, whose state (step, exp_avg, exp_avg_sq) appears only at its first
    step, and reads the step count from that per-parameter state in
    ``state_dict()`` (asserting one value): a fresh optimizer, as a resumed job
    has, cannot build its checkpoint state. Megatron's own ``init_state_fn``
    makes exp_avg / exp_avg_sq (FusedAdam keeps step in its param groups); add
    torch's step, a float32 CPU scalar 0, as Adam's lazy init would. Adam's next
    step then runs exactly as on an empty state, and loading overwrites all of it.
    """
    for optimizer in _megatron_optimizers(engine):
        inner = optimizer.optimizer if _torch_adam(optimizer) else None
        if inner is None or len(inner.state) > 0:
            continue
        optimizer.init_state_fn(inner, optimizer.config)
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param]["step"] = torch.zeros((), dtype=torch.float32)


def _load_optimizer(engine, state: Any) -> None:
    """Load the optimizer's part of a loaded checkpoint; the distributed optimizer's in two steps.

    Its ``load_state_dict`` restores the param groups and the step count, then
    copies the parameter state into every key of each parameter's live state.
    With torch's Adam that state also holds "step", which no sharding format
    stores (the step lives in the param groups), so the copy fails on it. Run
    the two steps here instead, the parameter state with "step" set aside, and
    give each parameter back its own step tensor: ``load_state_dict`` sets one
    shared tensor for all, which torch's Adam, incrementing each parameter's step
    in place, would advance once per parameter per step.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizers = _megatron_optimizers(engine)
    states = [state] if len(optimizers) == 1 else [v for _, v in sorted(state.items())]
    if len(states) != len(optimizers):
        raise ValueError(f"the checkpoint holds {len(states)} optimizer states, this job has {len(optimizers)} optimizers")
    for optimizer, part in zip(optimizers, states):
        if not isinstance(optimizer, DistributedOptimizer):
            optimizer.load_state_dict(part)
            continue
        part = dict(part)
        param_state = part.pop("param_state")
        kind = part.pop("param_state_sharding_type")
        if kind != DIST_OPT_SHARDING:
            raise ValueError(f"the distributed optimizer's state is stored as {kind!r}; this loader reads {DIST_OPT_SHARDING!r}")
        optimizer.load_state_dict(part)  # param groups, step count, grad scaler; no parameter state
        inner = optimizer.optimizer
        steps = {param: s.pop("step") for param, s in inner.state.items() if "step" in s}
        try:
            optimizer.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for param, step in steps.items():
                inner.state[param]["step"] = step.clone()
    if len(optimizers) > 1:
        synchronize_chained_steps(engine.optimizer)


def _sharded_state(engine, is_loading: bool) -> dict[str, Any]:
    # The grid's own DP group, where megatron would otherwise reach for its (unset) global one.
    dp_group = engine.groups.collection.dp_cp
    model_state = engine.module().sharded_state_dict(metadata={"dp_cp_group": dp_group})
    if engine.adapters:  # LoRA: the frozen base comes from the HF checkpoint; only what trains is saved
        trained = _trained_names(engine)
        model_state = {name: value for name, value in model_state.items() if name in trained}
    state = {"model": model_state}
    if engine.optimizer is not None:
        metadata = {"dp_cp_group": dp_group}
        if _uses_dist_opt(engine):
            _init_dist_opt_state(engine)
            metadata["distrib_optim_sharding_type"] = DIST_OPT_SHARDING
        state["optimizer"] = engine.optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
    return state


def _trained_names(engine) -> set[str]:
    return {name for name, p in engine.module().named_parameters() if p.requires_grad}


def _lora_settings(engine) -> dict[str, Any] | None:
    lora = engine.lora
    return None if lora is None else {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}


@contextlib.contextmanager
def _as_error(action: str, path: Path):
    """torch's CheckpointException derives from BaseException, past every ``except Exception`` (a worker's
    reply among them): an OSError instead, with each failing rank's own exception in a line."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = "; ".join(f"rank {rank}: {type(error).__name__}: {str(error).strip()[:200]}"
                             for rank, (error, _) in sorted(exc.failures.items()))
        raise OSError(f"the checkpoint {action} of {path} failed ({failures or 'on another rank'})") from None


def save_checkpoint(engine, root: str | Path, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Collective: save the engine's state as ``root/step_<step>``; returns that path."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    _check_pool_is_world(engine)
    pool, first, rank = engine.groups.pool_group, engine.groups.is_first, dist.get_rank()
    if first:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)  # empty: megatron takes a non-empty directory for an interrupted save
    dist.barrier(group=pool)
    fork_checkpoint_results_queue()
    with _as_error("write", tmp):
        dist_checkpointing.save(_sharded_state(engine, is_loading=False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if first:
        torch.save(
            {
                "step": step,
                "layout": str(engine.layout),
                "use_distributed_optimizer": _uses_dist_opt(engine),
                "precision": engine.config.precision,
                "lora": _lora_settings(engine),
                "scheduler": engine.scheduler.state_dict() if engine.scheduler else None,
                "extra": extra or {},
            },
            tmp / "extra.pt",
        )
    dist.barrier(group=pool)
    if first:
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / LATEST)
    dist.barrier(group=pool)
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
    _check_pool_is_world(engine)
    if engine.optimizer is not None:
        _check_optimizer_format(path, meta, engine)
    _check_lora(path, meta, engine)
    with _as_error("read", path):
        state = dist_checkpointing.load(_sharded_state(engine, is_loading=True), str(path))
    if engine.adapters:  # the adapters (and a value head) over the base the engine loaded from HF
        missing = _trained_names(engine) - set(state["model"])
        if missing:
            raise CheckpointNotFound(f"{path} lacks the trained tensors {sorted(missing)[:4]}")
        engine.module().load_state_dict(state["model"], strict=False)
    else:
        engine.module().load_state_dict(state["model"])
    if engine.optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointNotFound(f"{path} holds no optimizer state; it was saved by a role without one")
        _load_optimizer(engine, state["optimizer"])
        if meta["scheduler"] is not None:
            engine.scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if meta["layout"] == str(engine.layout) and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return {"step": meta["step"], **meta["extra"]}


def _check_pool_is_world(engine) -> None:
    """megatron's dist_checkpointing coordinates over the default (whole-world) group."""
    if len(engine.groups.ranks) != dist.get_world_size():
        raise ValueError(
            f"a megatron checkpoint is collective over the whole torch.distributed world of {dist.get_world_size()} "
            f"ranks, and this {engine.layout} role runs on ranks {list(engine.groups.ranks)} only: give the "
            f"checkpointed roles a pool that spans the world (on Ray, every pool is its own world)"
        )


def _check_lora(path: Path, meta: dict[str, Any], engine) -> None:
    """Refuse a checkpoint whose LoRA settings (or their absence) differ from this job's: a LoRA checkpoint
    holds only adapters, a full one no adapters."""
    saved, here = meta.get("lora"), _lora_settings(engine)
    if saved != here:
        raise ValueError(f"{path} was saved with lora={saved} and this job has lora={here}: resume with the "
                         f"same LoRA rank, alpha and targets (start a new run from an export to change them)")


def _check_optimizer_format(path: Path, meta: dict[str, Any], engine) -> None:
    """Refuse, naming both values, a checkpoint whose optimizer state this job's optimizer cannot read.

    The plain and the distributed optimizer store their state differently, and so
    do megatron's fp32 and mixed-precision (bf16, fp32 master weights) optimizers.
    Checkpoints from before these settings were recorded used neither the
    distributed optimizer nor bf16.
    """
    settings = {
        "use_distributed_optimizer": (meta.get("use_distributed_optimizer", False), _uses_dist_opt(engine)),
        "precision": (meta.get("precision", "fp32"), engine.config.precision),
    }
    wrong = [(name, saved, here) for name, (saved, here) in settings.items() if saved != here]
    if wrong:
        saved = ", ".join(f"{name}={value!r}" for name, value, _ in wrong)
        here = ", ".join(f"{name}={value!r}" for name, _, value in wrong)
        raise ValueError(
            f"{path} was saved with {saved} and this job has {here}; their optimizer states are stored in "
            f"different formats: resume with {saved}"
        )
