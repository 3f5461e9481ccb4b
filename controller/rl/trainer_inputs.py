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

__all__ = ["TrainerInputs", "job_algorithm", "trainer_arguments"]


@dataclass(frozen=True)
class TrainerInputs:
    train_data: Any = None  # a PromptDataset; None: loaded as config.data describes
    val_data: Any = None  # a PromptDataset; None: config.data's validation prompts, if any
    algorithm: Any = None  # an RLAlgorithm object; None: built from config.algorithm
    pool: Any = None  # the default ResourcePool, already started; None: one of trainer.nnodes x nproc
    logger: Any = None  # a MetricsLogger (anything with log(step, metrics)); None: no logging


def trainer_arguments(config, keywords: dict[str, Any]):
    """``RLTrainer``'s arguments as (the typed config, TrainerInputs): the config given (its hub ids resolved)
    with the object inputs by name, or the researcher's keyword form turned into that config
    (``controller.rl.trainer_builder.config_from_keywords``). Every keyword is checked now."""
    from controller.config import RLConfig
    from controller.rl.role_specs import with_resolved_paths
    from controller.rl.trainer_builder import config_from_keywords
    from workers.keywords import check_keywords

    if config is None:
        missing = [key for key in ("actor", "train_data", "batch_size") if key not in keywords]
        if missing:
            raise TypeError(f"RLTrainer takes a config, RLTrainer(config), or the keywords actor=, train_data= "
                            f"and batch_size= (with the rest of the job); missing: {missing}")
        check_keywords("RLTrainer", config_from_keywords, keywords)
        return config_from_keywords(**keywords)
    if not isinstance(config, RLConfig):
        raise TypeError(f"RLTrainer(config): config must be an RLConfig (controller.config.load_config), "
                        f"got {type(config).__name__}")
    check_keywords("RLTrainer(config, ...)", TrainerInputs, keywords)
    return with_resolved_paths(config), TrainerInputs(**keywords)  # hub ids: their cached snapshots


def job_algorithm(config, given: Any = None):
    """The job's RLAlgorithm: ``given`` (an object) or built from ``config.algorithm``; wrapped in Safe-RLHF's
    hooks where a cost is scored."""
    from controller.algorithms import SafeRLHF, build_algorithm
    from controller.algorithms.safe_rlhf import costed

    safe_rlhf = costed(config)
    if given is None:
        return build_algorithm(config.algorithm, safe_rlhf=safe_rlhf)
    return SafeRLHF(given) if safe_rlhf and not isinstance(given, SafeRLHF) else given
