"""Critic: a value model (scalar head) on the megatron training engine."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from workers.data_proto import DataProto
from workers.dispatch import Dispatch
from workers.megatron.config import EngineConfig, OptimConfig
from workers.megatron.lora import LoRAConfig
from workers.megatron.micro_batches import MicroBatch
from workers.megatron.engine_role import EngineRole
from workers.megatron.ppo_update import run_ppo_epochs, token_share
from workers.megatron.token_outputs import response_values
from workers.policy_losses import LOSS_AGG_MODES, LossNormalizer, value_loss
from workers.register import register

__all__ = ["Critic", "CriticConfig"]


@dataclass(frozen=True)
class CriticConfig:
    """The critic's update: its mini-batches, epochs and clipped value loss."""

    ppo_mini_batch_size: int = 8  # sequences per optimizer step, over all DP ranks
    ppo_epochs: int = 1  # passes over each step's batch, each split into mini-batches
    shuffle: bool = True  # reshuffle the batch before each epoch's split (seeded from engine.seed)
    clip_range_value: float = 0.5  # the new value is clipped to the old one +- this (the loss takes the larger)
    loss_agg_mode: str = "token-mean"  # how token losses are aggregated: one of LOSS_AGG_MODES
    # A critic started from a causal LM (the controller adds the value head): "zeros" (V = 0 at the start)
    # or "normal" (verl's: N(0, initializer_range^2))
    value_head_init: str = "zeros"

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
        if self.value_head_init not in ("zeros", "normal"):
            raise ValueError(f"value_head_init {self.value_head_init!r} is not one of ('zeros', 'normal')")


class Critic(EngineRole):
    @classmethod
    def declared_in_code(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A critic declared with ``from_pretrained`` whose ``critic`` section names no ``value_head_init``
        starts its value head as verl does, "normal" (the config file's default is "zeros")."""
        given = kwargs.get("critic")
        if given is None or (isinstance(given, dict) and "value_head_init" not in given):
            return {**kwargs, "critic": {**(given or {}), "value_head_init": "normal"}}
        return kwargs

    def __init__(
        self,
        model_path: str,
        engine: EngineConfig | None = None,
        optim: OptimConfig | None = None,
        critic: CriticConfig | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        """Each section typed, None: its defaults. ``lora``: LoRA adapters on the frozen base, the value head
        trained whole beside them."""
        self.critic = critic or CriticConfig()
        self._build_engine(model_path, engine, optim or OptimConfig(), value_model=True, lora=lora)

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto | None:
        def step(mb: MicroBatch, output: torch.Tensor):
            return output.new_zeros(()), {"values": response_values(self.engine, mb, output)}

        outputs = self.engine.run(data, step, forward_only=True)
        return DataProto({"values": outputs.rows("values")}) if outputs else None

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> dict[str, Any]:
        cfg = self.critic
        metrics = run_ppo_epochs(
            self.engine, data, cfg.ppo_mini_batch_size, cfg.ppo_epochs, cfg.shuffle,
            seed=self.engine.config.seed + self.update_count,
            make_step=lambda normalizer: partial(self._value_loss, normalizer=normalizer),
            prefix="critic",
        )
        self.update_count += 1
        return metrics

    def _value_loss(self, mb: MicroBatch, output: torch.Tensor, *, normalizer: LossNormalizer):
        cfg, mask = self.critic, mb["response_mask"]
        loss, stats = value_loss(
            response_values(self.engine, mb, output), mb["values"], mb["returns"], mask, cfg.clip_range_value, cfg.loss_agg_mode, normalizer
        )
        return loss, {"vf_loss": loss.detach(), "vf_clipfrac": stats["vf_clipfrac"] * token_share(mask, normalizer)}
