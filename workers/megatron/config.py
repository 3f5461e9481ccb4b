"""Typed settings of the megatron training engine: the one place their defaults live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EngineConfig", "OptimConfig", "LR_DECAY_STYLES", "as_config"]

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass(frozen=True)
class OptimConfig:
    """Adam via megatron's optimizer, and the LR schedule (warmup, then decay)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 1_000_000
    lr_decay_style: str = "constant"
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style {self.lr_decay_style!r} is not one of {LR_DECAY_STYLES}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.lr_warmup_steps < 0 or self.lr_decay_steps <= self.lr_warmup_steps:
            raise ValueError(
                f"lr_decay_steps ({self.lr_decay_steps}) must exceed lr_warmup_steps ({self.lr_warmup_steps}) >= 0"
            )


@dataclass(frozen=True)
class EngineConfig:
    """How a model is split and fed: TP/PP sizes, micro-batch size, seed."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    micro_batch_size: int = 1  # sequences per forward pass on one DP rank
    seed: int = 1
    # Log-prob roles (actor, reference): the output layer runs fused with the
    # log-prob and entropy (hybridengine.ops.linear_log_prob), so the
    # [tokens, vocab] logits are never held. False: megatron's output layer
    # makes the logits, then the fused log-prob op reads them.
    fused_output_layer: bool = True
    # As megatron's (which uses 128): embedding and output-layer rows are padded to a multiple of this
    # x tensor_parallel, so any TP size fits any vocabulary; padded ids take no probability mass and are
    # never exported. None: no padding, TP must divide the vocabulary.
    make_vocab_size_divisible_by: int | None = 128

    def __post_init__(self) -> None:
        value = self.make_vocab_size_divisible_by
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"make_vocab_size_divisible_by must be a positive integer (megatron uses 128) or null "
                             f"(no padding), got {value!r}")
        for name in ("tensor_parallel", "pipeline_parallel", "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.fused_output_layer, bool):
            raise ValueError(f"fused_output_layer must be true or false, got {self.fused_output_layer!r}")


def as_config(cls, value: Any):
    """A typed config from an instance, a dict of its fields, or None (defaults)."""
    return value if isinstance(value, cls) else cls(**(value or {}))
