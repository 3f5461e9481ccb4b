"""The training job behind ``hybridflow train`` and ``tools/train.py``: a config in, a trained run dir out.

Under torchrun every rank runs this; the first resource pool turns ranks
1.. into workers and rank 0 drives the loop. With the Ray launcher the
calling process drives the loop and Ray starts the workers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from controller.config import RLConfig, check_config, config_to_dict
from controller.data import arithmetic_prompts, load_jsonl_prompts
from controller.models import resolve_model_path, value_model_from_policy
from controller.torchrun_backend import under_torchrun

__all__ = ["prepare_model", "run_training"]


def prepare_model(config: RLConfig) -> str:
    """The policy checkpoint (built-ins written into the run dir), checked against the config; before any process."""
    from hybridengine.model_spec import ModelSpec

    run_dir = Path(config.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(config.model_path, run_dir)
    check_config(config, ModelSpec.from_pretrained(model))
    return model


def _datasets(config: RLConfig):
    data = config.data
    if data.task == "arithmetic":
        return (arithmetic_prompts(data.train_size, data.seed, data.max_operand),
                arithmetic_prompts(data.val_size, data.seed + 1, data.max_operand) if data.val_size else None)
    train = load_jsonl_prompts(data.train_file, data.prompt_key, data.answer_key)
    val = load_jsonl_prompts(data.val_file, data.prompt_key, data.answer_key) if data.val_file else None
    return train, val


def run_training(config: RLConfig) -> Path:
    from controller.metrics_log import MetricsLogger
    from controller.resource_pool import ResourcePool
    from controller.trainer import RLTrainer
    from workers.actor import Actor
    from workers.critic import Critic
    from workers.reward import RewardModel
    from workers.rollout import Rollout

    trainer_cfg = config.trainer
    if under_torchrun():
        check_config(config)  # every rank, before any group forms
        pool = ResourcePool([int(os.environ["WORLD_SIZE"])], backend="torchrun")  # ranks 1.. serve from here on
    else:
        pool = None
    model = prepare_model(config)
    if pool is None:
        pool = ResourcePool([trainer_cfg.nproc], backend="ray")
    run_dir = Path(trainer_cfg.run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    alg = config.algorithm
    actor = Actor.from_pretrained(config.actor.model_path or model, engine=config.actor.engine.__dict__,
                                  tensor_parallel=config.actor.engine.tensor_parallel,
                                  pipeline_parallel=config.actor.engine.pipeline_parallel,
                                  micro_batch_size=config.actor.engine.micro_batch_size,
                                  optim=config.actor.optim, ppo=config.ppo)
    rollout_cfg = config_to_dict(config.rollout)
    rollout = Rollout.from_pretrained(model, **rollout_cfg)
    critic = None
    if alg.needs_critic:
        value_path = config.critic.model_path or value_model_from_policy(model, run_dir / "critic-init")
        critic = Critic.from_pretrained(value_path, tensor_parallel=config.critic.engine.tensor_parallel,
                                        pipeline_parallel=config.critic.engine.pipeline_parallel,
                                        micro_batch_size=config.critic.engine.micro_batch_size,
                                        optim=config.critic.optim, critic=config.critic_ppo)
    reward_model = None
    if config.reward.model_path:
        reward_model = RewardModel.from_pretrained(config.reward.model_path,
                                                   tensor_parallel=config.actor.engine.tensor_parallel,
                                                   pipeline_parallel=config.actor.engine.pipeline_parallel)
    train, val = _datasets(config)
    logger = MetricsLogger(run_dir, backends=trainer_cfg.logger, total_steps=trainer_cfg.total_steps,
                           config=config_to_dict(config), resume=trainer_cfg.resume)
    trainer = RLTrainer(
        actor=actor, rollout=rollout, critic=critic, reward_model=reward_model,
        reward_fn=config.reward.fn if reward_model is None else None, cost_fn=alg.safe_rlhf_cost_fn,
        algorithm=alg, train_data=train, val_data=val, batch_size=config.data.batch_size, pool=pool,
        run_dir=run_dir, logger=logger, save_every=trainer_cfg.save_every, val_every=trainer_cfg.val_every,
        seed=trainer_cfg.seed, shuffle=config.data.shuffle,
    )
    for role, devices in trainer_cfg.placement.items():
        trainer.register_placement(role, devices)
    try:
        if trainer_cfg.resume:
            step = trainer.resume()
            logger.truncate_after(step + 1)  # lines 1..step are the checkpoint's own steps
            print(f"[hybridflow] resumed at step {step} from {run_dir / 'checkpoints'}", file=sys.stderr)
        trainer.fit(trainer_cfg.total_steps)
        logger.close()
        outputs = {"metrics": run_dir / "metrics.jsonl"}
        if trainer_cfg.export_hf:
            outputs["HF checkpoint"] = trainer.export_hf(run_dir / "hf_actor")
        plots = []
        if trainer_cfg.plots:
            from controller.plots import plot_run  # matplotlib only when asked

            plots = plot_run(run_dir)
        print(f"[hybridflow] done: {trainer.global_step} steps in {run_dir}")
        print(f"[hybridflow]   metrics:        {outputs['metrics']} (TensorBoard: {run_dir / 'tensorboard'})")
        for path in plots:
            print(f"[hybridflow]   plot:           {path}")
        if "HF checkpoint" in outputs:
            print(f"[hybridflow]   HF checkpoint:  {outputs['HF checkpoint']}")
    finally:
        trainer.shutdown()
    return run_dir


def export_checkpoint(config: RLConfig, out: str | Path) -> Path:
    """Load the run's newest actor checkpoint at its training layout and write it as an HF directory."""
    from transformers import AutoTokenizer

    from controller.resource_pool import ResourcePool
    from controller.worker_group import WorkerGroup
    from workers.actor import Actor

    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else config.trainer.nproc
    pool = ResourcePool([world], backend="torchrun" if under_torchrun() else "ray")
    run_dir = Path(config.trainer.run_dir)
    model = resolve_model_path(config.model_path, run_dir)
    try:
        actor = WorkerGroup(pool, Actor, role="actor", kwargs={"model_path": config.actor.model_path or model,
                                                               "engine": config.actor.engine})
        actor.load_checkpoint(str(run_dir / "checkpoints" / "actor"))
        actor.save_hf(str(out))
        AutoTokenizer.from_pretrained(model).save_pretrained(str(out))
        print(f"[hybridflow] wrote the actor of {run_dir} as an HF checkpoint: {out}")
    finally:
        pool.shutdown()
    return Path(out)
