"""The training job behind ``hybridflow train`` and ``tools/train.py``: a config in, a trained run dir out.

Under torchrun every rank runs this; the first resource pool turns ranks
1.. into workers and rank 0 drives the loop. With the Ray launcher the
calling process drives the loop and Ray starts the workers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from controller.config import ConfigError, RLConfig, check_config, config_to_dict
from controller.data.prepare import JobPrompts
from controller.rl.job_prompts import rl_job_prompts
from controller.jobs.job_pool import torchrun_pool
from controller.models.builtin import resolve_model_path
from controller.runtime.placement import ClusterNode
from controller.runtime.torchrun_backend import under_torchrun

__all__ = ["check_job", "prepare_job", "run_training"]


def prepare_job(config: RLConfig, log: Callable[[str], None] | None = None,
                cluster: list[ClusterNode] | None = None) -> tuple[str, JobPrompts]:
    """The policy checkpoint and the prompts, checked against the config and each other; before any process.

    The prompts are loaded, rendered and tokenized with the actor's tokenizer,
    overlong ones dropped or refused, and, with ``reward.fn: auto``, every
    ``data_source`` must have a scorer. ``cluster`` (the Ray cluster's nodes)
    adds the check that the job's pools fit it.
    """
    run_dir = Path(config.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(config.model_path, run_dir)
    check_job(config, model, cluster)
    return model, rl_job_prompts(config, config.actor.model_path or model, log)


def check_job(config: RLConfig, model: str, cluster: list[ClusterNode] | None = None) -> None:
    """``check_config`` with the policy's and the reward model's shapes (and the Ray cluster's nodes)."""
    from hybridengine.model.spec import ModelSpec
    from workers.reward.hf_reward_model import check_reward_checkpoint
    from workers.reward.reward_model import megatron_spec_or_none

    reward_spec = None
    if config.reward.model_path:  # any one-label HF classifier; one megatron holds runs there (its split checked)
        try:
            check_reward_checkpoint(config.reward.model_path)
        except ValueError as exc:
            raise ConfigError(f"reward.model_path: {exc}") from None
        reward_spec = megatron_spec_or_none(config.reward.model_path)
    check_config(config, ModelSpec.from_pretrained(model), cluster, reward_spec)


def run_training(config: RLConfig, prepared: tuple[str, JobPrompts] | None = None) -> Path:
    """Train; ``prepared`` is ``prepare_job``'s result when the caller already checked (Ray: the same process).

    With Ray this process restarts the job after a lost worker or node or a hang, within
    ``trainer.max_restarts`` (``controller.jobs.relaunch``); under torchrun the launching command does.
    """
    from controller.jobs.relaunch import data_parallel, run_restarting
    from controller.jobs.restarts import RESTART_ENV, restart_fields
    from controller.runtime.resource_pool import ResourcePool

    if under_torchrun():
        check_config(config)  # every rank, before any group forms
        pool = torchrun_pool(config.trainer)
        # The launching process has already checked and reported the data: rank 0 stays quiet.
        _, prompts = prepared or prepare_job(config, log=lambda line: None)
        return _train(config, prompts, pool, restart_fields(int(os.environ.get(RESTART_ENV, 0)), data_parallel(config)))
    model, prompts = prepared or prepare_job(config)

    def attempt(config: RLConfig, fields: dict[str, float]) -> Path:
        trainer_cfg = config.trainer
        pool = ResourcePool([trainer_cfg.nproc] * trainer_cfg.nnodes, backend="ray",
                            ray_address=trainer_cfg.ray_address)
        print(f"[hybridflow] Ray pool of the actor and colocated roles: {pool.describe()}", file=sys.stderr)
        return _train(config, prompts, pool, fields)

    def check(config: RLConfig, nodes: list[dict]) -> None:
        check_job(config, model, [ClusterNode(n["address"], n["CPU"], n["GPU"]) for n in nodes])

    return run_restarting(config, attempt, check, mini_batch=lambda c: c.ppo.ppo_mini_batch_size)


def _train(config: RLConfig, prompts: JobPrompts, pool, fields: dict[str, float] | None = None) -> Path:
    """One run of the job on ``pool``: resumed when ``trainer.resume``, torn down however it ends."""
    from controller.metrics.log import MetricsLogger, read_metrics
    from controller.rl.trainer import RLTrainer

    trainer_cfg = config.trainer
    run_dir = Path(trainer_cfg.run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    logger = MetricsLogger(run_dir, backends=trainer_cfg.logger, total_steps=trainer_cfg.total_steps,
                           config=config_to_dict(config), resume=trainer_cfg.resume, fields=fields)
    trainer = RLTrainer(config, train_data=prompts.train, val_data=prompts.val, pool=pool, logger=logger)
    try:
        if trainer_cfg.resume:
            step = trainer.resume()
            logger.truncate_after(step + 1)  # lines 1..step are the checkpoint's own steps
            print(f"[hybridflow] resumed at step {step} from {run_dir / 'checkpoints'}", file=sys.stderr)
        trainer.fit(trainer_cfg.total_steps)
        logger.close()
        outputs = {"metrics": run_dir / "metrics.jsonl"}
        if trainer_cfg.export_hf:
            outputs["HF checkpoint"] = trainer.export_hf(run_dir / "hf_actor", trainer_cfg.export_precision)
            if config.actor.lora.enabled:  # the adapters too, in PEFT's format (hf_actor holds them merged)
                outputs["PEFT adapter"] = trainer.export_peft(run_dir / "lora_adapter")
        plots = []
        if trainer_cfg.plots:
            from controller.metrics.plots import plot_run  # matplotlib only when asked

            plots = plot_run(run_dir)
        print(f"[hybridflow] done: {trainer.global_step} steps in {run_dir}")
        print(f"[hybridflow]   metrics:        {outputs['metrics']} (TensorBoard: {run_dir / 'tensorboard'})")
        for path in plots:
            print(f"[hybridflow]   plot:           {path}")
        if "HF checkpoint" in outputs:
            print(f"[hybridflow]   HF checkpoint:  {outputs['HF checkpoint']}")
        if "PEFT adapter" in outputs:
            print(f"[hybridflow]   PEFT adapter:   {outputs['PEFT adapter']}")
        if "jsonl" in trainer_cfg.logger:
            _print_validation(config, read_metrics(run_dir))
    finally:
        trainer.shutdown()
        logger.close()  # (closed already when the run finished)
    return run_dir


def _print_validation(config: RLConfig, records: list[dict]) -> None:
    """The closing lines on validation: the first and last greedy score and, when the job started
    from an SFT run's export, that run's validation loss, the first score being the SFT model's."""
    from controller.metrics.log import read_metrics, validation_summary
    from controller.jobs.run_dirs import sft_run_of

    sft_run = sft_run_of(config.actor.model_path or config.model_path)
    from_sft = sft_run is not None and any(r.get("step") == 0 and "val/reward/mean" in r for r in records)
    if from_sft and (loss := validation_summary(read_metrics(sft_run), "sft/val_loss")):
        print(f"[hybridflow]   SFT run:        {sft_run}: {loss}")
    validation = validation_summary(records, labels=("after SFT", "after RL") if from_sft else None)
    if validation is not None:
        print(f"[hybridflow]   validation:     {validation} (greedy; reward {config.reward.fn or config.reward.model_path})")


def export_checkpoint(config: RLConfig, out: str | Path) -> Path:
    """Load the run's newest actor checkpoint at its training layout and write it as an HF directory."""
    from transformers import AutoTokenizer

    from controller.runtime.resource_pool import ResourcePool
    from controller.runtime.worker_group import WorkerGroup
    from workers.actor import Actor

    trainer_cfg = config.trainer
    if under_torchrun():
        pool = ResourcePool([int(os.environ["WORLD_SIZE"])], backend="torchrun")
    else:
        pool = ResourcePool([trainer_cfg.nproc] * trainer_cfg.nnodes, backend="ray",
                            ray_address=trainer_cfg.ray_address)
    run_dir = Path(config.trainer.run_dir)
    model = resolve_model_path(config.model_path, run_dir)
    try:
        actor = WorkerGroup(pool, Actor, role="actor", kwargs={"model_path": config.actor.model_path or model,
                                                               "engine": config.actor.engine})
        actor.load_checkpoint(str(run_dir / "checkpoints" / "actor"))
        actor.save_hf(str(out), config.trainer.export_precision)
        AutoTokenizer.from_pretrained(model).save_pretrained(str(out))
        print(f"[hybridflow] wrote the actor of {run_dir} as an HF checkpoint: {out}")
    finally:
        pool.shutdown()
    return Path(out)
