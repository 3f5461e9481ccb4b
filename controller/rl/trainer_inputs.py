"""TrainerInputs: what an RL job is given as Python objects beside its typed config.

A config holds values: YAML can write every one of them. Some inputs are objects a config can only
describe: the prompt datasets (``data.*`` describes files or a built-in task; ``train_data=`` is
the dataset itself), an algorithm object with its own state, a resource pool already started, a
metrics logger. ``RLTrainer(config, train_data=..., ...)`` takes them by name; None takes what the
config describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TrainerInputs"]


@dataclass(frozen=True)
class TrainerInputs:
    train_data: Any = None  # a PromptDataset; None: loaded as config.data describes
    val_data: Any = None  # a PromptDataset; None: config.data's validation prompts, if any
    algorithm: Any = None  # an RLAlgorithm object; None: built from config.algorithm
    pool: Any = None  # the default ResourcePool, already started; None: one of trainer.nnodes x nproc
    logger: Any = None  # a MetricsLogger (anything with log(step, metrics)); None: no logging
