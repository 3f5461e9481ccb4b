"""The learning-rate schedule: linear warmup from 0, then constant / linear / cosine /
inverse-square-root decay to ``min_lr``, by megatron's OptimizerParamScheduler."""

from __future__ import annotations

from workers.megatron.config import OptimConfig

__all__ = ["build_lr_scheduler"]


def build_lr_scheduler(optimizer, optim: OptimConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=optim.lr_decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=optim.lr_decay_steps,
        wd_incr_style="constant",
    )
