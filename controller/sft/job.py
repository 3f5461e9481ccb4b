"""The SFT job behind ``hybridflow sft``: a config in, a fine-tuned run dir (and HF checkpoint) out.

As with ``hybridflow train``: under torchrun every rank runs this and rank 0 drives the loop; with the
Ray launcher the calling process drives it. ``trainer.export_hf`` writes ``RUN_DIR/hf_actor``, which an
RL job's ``model_path`` can name directly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from controller.config import ConfigError
from controller.data.images import ImageProcessing
from controller.data.sft_rows import SFTData, load_sft_examples
from controller.models.builtin import resolve_model_path
from controller.sft.config import SFTConfig, check_sft_config, sft_config_to_dict
from controller.runtime.torchrun_backend import under_torchrun

__all__ = ["prepare_sft", "run_sft"]


def prepare_sft(config: SFTConfig, log: Callable[[str], None] | None = None) -> tuple[str, SFTData]:
    """The model checkpoint and the encoded examples, checked against the config; before any process."""
    from transformers import AutoTokenizer

    from hybridengine.model.spec import ModelSpec

    run_dir = Path(config.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(config.model_path, run_dir)
    check_sft_config(config, ModelSpec.from_pretrained(config.actor.model_path or model))
    tokenizer = AutoTokenizer.from_pretrained(config.actor.model_path or model)
    try:
        data = load_sft_examples(config.data, tokenizer, log, ImageProcessing.for_model(config.actor.model_path or model))
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"data: {exc}") from None
    return model, data


def run_sft(config: SFTConfig, prepared: tuple[str, SFTData] | None = None) -> Path:
    """Fine-tune; with Ray, restarted after a lost worker or node or a hang within ``trainer.max_restarts``
    (``controller.jobs.relaunch``; under torchrun the launching command restarts)."""
    import os

    from controller.jobs.job_pool import torchrun_pool
    from controller.jobs.relaunch import data_parallel, run_restarting
    from controller.jobs.restarts import RESTART_ENV, restart_fields
    from controller.runtime.resource_pool import ResourcePool
    from hybridengine.model.spec import ModelSpec

    if under_torchrun():
        check_sft_config(config)  # every rank, before any group forms
        pool = torchrun_pool(config.trainer)
        model, data = prepared or prepare_sft(config, log=lambda line: None)
        return _fine_tune(config, model, data, pool,
                          restart_fields(int(os.environ.get(RESTART_ENV, 0)), data_parallel(config)))
    model, data = prepared or prepare_sft(config)

    def attempt(config: SFTConfig, fields: dict[str, float]) -> Path:
        pool = ResourcePool([config.trainer.nproc] * config.trainer.nnodes, backend="ray",
                            ray_address=config.trainer.ray_address)
        return _fine_tune(config, model, data, pool, fields)

    def check(config: SFTConfig, nodes: list[dict]) -> None:
        check_sft_config(config, ModelSpec.from_pretrained(config.actor.model_path or model))

    return run_restarting(config, attempt, check, mini_batch=lambda c: c.data.batch_size)


def _fine_tune(config: SFTConfig, model: str, data: SFTData, pool, fields: dict[str, float]) -> Path:
    """One run of the job on ``pool``: resumed when ``trainer.resume``, torn down however it ends."""
    from transformers import AutoTokenizer

    from controller.metrics.log import MetricsLogger, read_metrics, validation_summary
    from controller.sft.trainer import SFTTrainer
    from workers.actor import Actor

    trainer_cfg = config.trainer
    run_dir = Path(trainer_cfg.run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(sft_config_to_dict(config), sort_keys=False))
    engine = config.actor.engine
    model_path = config.actor.model_path or model
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    actor = Actor.from_pretrained(model_path, engine=engine, tensor_parallel=engine.tensor_parallel,
                                  pipeline_parallel=engine.pipeline_parallel, micro_batch_size=engine.micro_batch_size,
                                  optim=config.actor.optim,
                                  **({"lora": config.actor.lora} if config.actor.lora.enabled else {}),
                                  **({} if config.actor.freeze_vision_tower else {"freeze_vision_tower": False}))
    logger = MetricsLogger(run_dir, backends=trainer_cfg.logger, total_steps=trainer_cfg.total_steps,
                           config=sft_config_to_dict(config), resume=trainer_cfg.resume, fields=fields)
    trainer = SFTTrainer(actor=actor, train=data.train, val=data.val, batch_size=config.data.batch_size,
                         pad_token_id=pad, pool=pool, run_dir=run_dir, logger=logger,
                         save_every=trainer_cfg.save_every, val_every=trainer_cfg.val_every,
                         seed=trainer_cfg.seed, shuffle=config.data.shuffle, max_bad_steps=trainer_cfg.max_bad_steps,
                         hang_timeout_s=trainer_cfg.hang_timeout_s, images=ImageProcessing.for_model(model_path))
    try:
        if trainer_cfg.resume:
            step = trainer.resume()
            logger.truncate_after(step + 1)
            print(f"[hybridflow] resumed at step {step} from {run_dir / 'checkpoints'}", file=sys.stderr)
        trainer.fit(trainer_cfg.total_steps)
        logger.close()
        lines = [f"[hybridflow] done: {trainer.global_step} SFT steps in {run_dir}",
                 f"[hybridflow]   metrics:        {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tensorboard'})"]
        if trainer_cfg.export_hf:
            out = trainer.export_hf(run_dir / "hf_actor", trainer_cfg.export_precision)
            lines.append(f"[hybridflow]   HF checkpoint:  {out} (an RL job's model_path can name it)")
            if config.actor.lora.enabled:  # hf_actor holds the adapters merged; this, the adapters alone
                peft = trainer.export_peft(run_dir / "lora_adapter")
                lines.append(f"[hybridflow]   PEFT adapter:   {peft} (peft.PeftModel.from_pretrained(base, it); an RL "
                             f"job's actor.lora.adapter_path can name it)")
        if trainer_cfg.plots:
            from controller.metrics.plots import plot_run

            lines += [f"[hybridflow]   plot:           {path}" for path in plot_run(run_dir)]
        if "jsonl" in trainer_cfg.logger and (loss := validation_summary(read_metrics(run_dir), "sft/val_loss")):
            lines.append(f"[hybridflow]   validation:     {loss} (token-mean cross-entropy, {len(data.val)} examples)")
        print("\n".join(lines))
    finally:
        trainer.shutdown()
        logger.close()  # (closed already when the run finished)
    return run_dir
