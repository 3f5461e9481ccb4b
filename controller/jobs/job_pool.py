"""The job's pool under torchrun, once torchrun is seen to have started the processes the config asks for
(``hybridflow train`` and ``hybridflow sft`` alike)."""

from __future__ import annotations

import os

from controller.config import TrainerConfig
from controller.errors import ConfigError

__all__ = ["torchrun_pool"]


def torchrun_pool(trainer_cfg: TrainerConfig):
    """Under torchrun: the job's pool of every rank (ranks 1.. serve from here on), once torchrun is
    seen to have started the processes the config asks for."""
    from controller.runtime.resource_pool import ResourcePool

    world = int(os.environ["WORLD_SIZE"])
    if world != trainer_cfg.nnodes * trainer_cfg.nproc:
        raise ConfigError(f"torchrun started WORLD_SIZE={world} processes, but trainer.nnodes x nproc = "
                          f"{trainer_cfg.nnodes} x {trainer_cfg.nproc}; launch with --nnodes "
                          f"{trainer_cfg.nnodes} --nproc-per-node {trainer_cfg.nproc} or change the config")
    return ResourcePool([world], backend="torchrun")
