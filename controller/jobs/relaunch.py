"""The Ray driver's restart loop: a job run again on the nodes still healthy, from its newest checkpoint.

    run_dir = run_restarting(config, attempt, check, mini_batch=lambda c: c.ppo.ppo_mini_batch_size)

``attempt(config, fields)`` runs the job once (building its pools, resuming when
``config.trainer.resume``, tearing everything down when it returns or raises);
``fields`` are values the metrics logger adds to every record after a restart
(``job/restarts``, ``job/data_parallel``). After a failure that ``restartable``
accepts, within ``trainer.max_restarts``:

1. the nodes are asked, each with a task pinned to it, whether they still run
   (a node the GCS has not yet marked dead does not answer, and is left out);
2. ``trainer.nnodes`` becomes the number of healthy nodes that hold ``nproc``
   processes, if fewer: the actor's data-parallel size shrinks with it and its
   global batch stays, each rank running more micro-batches (said in the
   console and the metrics);
3. ``check(config)`` refuses a layout that does not fit (the job then stops,
   naming why), and the job resumes from its newest complete checkpoint, the
   same metrics file continued.

Under torchrun the launching command restarts the whole ``torchrun`` instead
(``controller.cli``): the world there is fixed for a launch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from controller.checks.placement import job_pools
from controller.config import ConfigError
from controller.errors import TrainingStoppedError
from controller.jobs.restarts import RestartBudget, describe, restart_fields, restartable

__all__ = ["run_restarting", "data_parallel", "healthy_node_count"]

T = TypeVar("T")


def data_parallel(config) -> int:
    """The actor's data-parallel size (the replicas that take rows of their own) under ``config``'s pools and its
    TP x PP (x EP, x CP) split."""
    pools = job_pools(config.trainer)
    world = pools.get("actor", pools["default"]).world_size
    return config.actor.engine.layout(world).data_replicas


def healthy_node_count(nodes: list[dict], nproc: int, gpus: bool) -> int:
    """How many of ``nodes`` (``cluster_nodes`` entries) hold ``nproc`` processes of the job's default pool."""
    return sum(node["GPU" if gpus else "CPU"] >= nproc for node in nodes)


def run_restarting(config, attempt: Callable[[Any, dict], T], check: Callable[[Any, list], None],
                   mini_batch: Callable[[Any], int]) -> T:
    """Run ``attempt`` until it returns; after each restartable failure, again on the healthy nodes,
    resumed (see the module doc). ``check(config, nodes)`` raises ``ConfigError`` for a config the
    healthy ``nodes`` cannot run; ``mini_batch(config)`` is the actor's global (mini-)batch in sequences."""
    from controller.runtime.ray_backend import healthy_nodes
    from hybridengine.device import accelerator_count

    trainer = config.trainer
    budget = RestartBudget(trainer.max_restarts, trainer.restart_window_s,
                           log_path=Path(trainer.run_dir) / "restarts.jsonl")
    fields: dict[str, float] = {}
    while True:
        try:
            return attempt(config, fields)
        except Exception as error:  # noqa: BLE001 - sorted by restartable; anything else goes on up
            if config.trainer.max_restarts == 0 or not restartable(error):
                raise
            print(f"[hybridflow] the job failed: {error}", file=sys.stderr, flush=True)
            number = budget.admit(describe(error))  # a crash loop stops here, listing the failures
        started = time.monotonic()
        nodes = healthy_nodes()
        count = min(config.trainer.nnodes, healthy_node_count(nodes, config.trainer.nproc, accelerator_count() > 0))
        before = data_parallel(config)
        resized = replace(config, trainer=replace(config.trainer, nnodes=max(count, 1), resume=True))
        try:
            if count == 0:
                raise ConfigError(f"no healthy node holds trainer.nproc={config.trainer.nproc} processes")
            check(resized, nodes)
        except ConfigError as exc:
            raise TrainingStoppedError(f"cannot restart on the {len(nodes)} healthy node(s) "
                                       f"{[n['address'] for n in nodes]}: {exc}") from None
        after = data_parallel(resized)
        budget.record(nodes=[n["address"] for n in nodes], nnodes=[config.trainer.nnodes, count],
                      data_parallel=[before, after], checked_s=round(time.monotonic() - started, 3))
        print(f"[hybridflow] restart {number} (at most {trainer.max_restarts} within {trainer.restart_window_s:g} s): "
              f"{count} healthy node(s) of {config.trainer.nnodes}; resuming from the newest complete checkpoint"
              + _resize_note(config, before, after, mini_batch), file=sys.stderr, flush=True)
        fields = restart_fields(number, after)
        config = resized


def _resize_note(config, before: int, after: int, mini_batch: Callable[[Any], int]) -> str:
    if before == after:
        return f" at the same data-parallel size, {after}"
    engine = config.actor.engine
    batch = mini_batch(config)
    micro = engine.micro_batch_size

    def per_rank(dp: int) -> str:
        share = batch // dp
        return f"{share} sequences a rank" + (f" in {share // micro} micro-batches of {micro}" if micro else "")

    return (f" at data-parallel size {after} instead of {before}: the global batch of {batch} sequences is kept, "
            f"{per_rank(after)} instead of {per_rank(before)}")
