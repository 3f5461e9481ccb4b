"""Typed settings of the megatron training engine: the one place their defaults live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridengine.parallel.layout import ParallelLayout

__all__ = ["ATTENTIONS", "EngineConfig", "OptimConfig", "RouterOptions", "LR_DECAY_STYLES", "PRECISIONS",
           "RECOMPUTE_GRANULARITIES", "check_precision"]

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
# bf16: parameters and activations in bf16 (megatron's Float16Module), fp32 master weights and fp32 gradient
# reduction in megatron's mixed-precision optimizer. fp32: everything in fp32 (what parity tests compare).
PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}
# megatron's activation recomputation: "full" recomputes whole layers in the backward pass (memory for time),
# "selective" only the attention core.
RECOMPUTE_GRANULARITIES = ("full", "selective")
# The attention of packed sequences and context parallelism (EngineConfig.attention)
ATTENTIONS = ("local", "transformer_engine")


@dataclass(frozen=True)
class OptimConfig:
    """Adam via megatron's optimizer, and the LR schedule (warmup, then decay)."""

    lr: float = 1e-6  # the peak learning rate, reached at the end of warmup
    min_lr: float = 0.0  # the LR that decay ends at (at lr_decay_steps); unused by the constant style
    weight_decay: float = 0.0  # Adam's weight decay (decoupled, AdamW-style); constant over the run
    adam_beta1: float = 0.9  # Adam's decay rate of the gradient's running mean
    adam_beta2: float = 0.999  # Adam's decay rate of the squared gradient's running mean
    adam_eps: float = 1e-8  # Adam's epsilon, added to the denominator
    clip_grad: float = 1.0  # gradients clipped to this global L2 norm before each step; 0: no clipping
    # optimizer steps (one per mini-batch, not per training step) of linear warmup from 0 to lr
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 1_000_000  # the optimizer step (warmup included) at which decay reaches min_lr
    # after warmup: "constant" (stays at lr), "linear", "cosine" or "inverse-square-root" (down to min_lr)
    lr_decay_style: str = "constant"
    # megatron's distributed optimizer: Adam state (and bf16's fp32 master weights) sharded over the DP ranks
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
class RouterOptions:
    """A mixture of experts' router in training: its auxiliary losses and expert capacity."""

    aux_loss_coeff: float = 0.0  # the load-balancing loss (Switch-style, per micro-batch) x this; 0: off
    z_loss_coeff: float = 0.0  # the router z-loss (mean squared logsumexp of the logits) x this; 0: off
    capacity_factor: float | None = None  # tokens beyond this x the even share of an expert are dropped; None: none

    def __post_init__(self) -> None:
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"moe_{name} must be a number >= 0 (0: off), got {value!r}")
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
            raise ValueError(f"moe_capacity_factor must be a number > 0 or null (dropless), got {factor!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How a model is split, stored and fed: TP/PP sizes, precision, micro-batches, seed."""

    tensor_parallel: int = 1  # TP size: each layer's weights split over this many ranks
    pipeline_parallel: int = 1  # PP size: the layers split into this many stages (DP = ranks / (TP x PP))
    micro_batch_size: int = 1  # sequences per forward pass on one DP rank
    # A token budget instead (verl's ppo_max_token_len_per_gpu): rows grouped by length so that each
    # micro-batch holds at most this many real tokens; micro_batch_size is then unused. None: fixed size.
    max_tokens_per_micro_batch: int | None = None
    # megatron's model-parallel RNG seed; a PPO update's mini-batch shuffle draws from it (+ update count)
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
    precision: str = "bf16"  # one of PRECISIONS
    # Activation recomputation (megatron's recompute_granularity; None: keep every activation). "full" takes
    # recompute_num_layers layers per recomputed block (megatron's "uniform" method).
    recompute_granularity: str | None = None
    recompute_num_layers: int = 1  # "full" only: layers per recomputed block
    # Mixture-of-experts models only. EP: a layer's experts split into this many groups of whole experts,
    # over the data-parallel (x tensor-parallel) ranks of a pipeline stage, as megatron folds them.
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None  # ETP: each expert split this many ways; null: as tensor_parallel
    moe_aux_loss_coeff: float = 0.0  # the router's load-balancing loss coefficient; 0: off
    moe_z_loss_coeff: float = 0.0  # the router's z-loss coefficient; 0: off
    moe_capacity_factor: float | None = None  # tokens over this x an expert's even share are dropped; null: none
    # CP: this many data-parallel ranks share their rows and split each sequence between them (zigzag: 2 x CP
    # chunks, rank r holding chunks r and 2CP-1-r, so causal attention work is even); K/V all-gathered over them.
    context_parallel: int = 1
    # Packed sequences: a micro-batch's rows back to back with no padding, attention kept within each row
    # (cu_seqlens) and positions restarting per row; with max_tokens_per_micro_batch rows fill each micro-batch
    # up to that many tokens.
    pack_sequences: bool = False
    # The attention of packed sequences and CP: "local", the engine's own (torch's fused kernels, CPU and GPU), or
    # "transformer_engine", transformer-engine's THD and CP kernels (a GPU with transformer-engine installed).
    attention: str = "local"

    def __post_init__(self) -> None:
        check_precision(self.precision)
        self.router  # RouterOptions checks the moe_* values
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise ValueError(f"max_tokens_per_micro_batch must be a positive integer or null (fixed micro-batches of "
                             f"micro_batch_size), got {budget!r}")
        if self.recompute_granularity is not None and self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES} or null, "
                             f"got {self.recompute_granularity!r}")
        if not isinstance(self.recompute_num_layers, int) or self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers must be a positive integer, got {self.recompute_num_layers!r}")
        value = self.make_vocab_size_divisible_by
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"make_vocab_size_divisible_by must be a positive integer (megatron uses 128) or null "
                             f"(no padding), got {value!r}")
        etp = self.expert_tensor_parallel
        if etp is not None and (not isinstance(etp, int) or isinstance(etp, bool) or etp < 1):
            raise ValueError(f"expert_tensor_parallel must be a positive integer or null (the dense TP size), "
                             f"got {etp!r}")
        for name in ("tensor_parallel", "pipeline_parallel", "micro_batch_size", "expert_parallel", "context_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.fused_output_layer, bool):
            raise ValueError(f"fused_output_layer must be true or false, got {self.fused_output_layer!r}")
        if not isinstance(self.pack_sequences, bool):
            raise ValueError(f"pack_sequences must be true or false, got {self.pack_sequences!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.context_parallel > 1 and self.expert_parallel > 1:
            raise ValueError(f"context_parallel {self.context_parallel} with expert_parallel {self.expert_parallel}: "
                             "context parallelism does not take expert parallelism yet; set one of them to 1")

    def layout(self, world_size: int) -> ParallelLayout:
        """This engine's grid over ``world_size`` ranks (data-parallel over what TP x PP leaves, CP among them)."""
        return ParallelLayout.for_world(world_size, self.tensor_parallel, self.pipeline_parallel, self.expert_parallel,
                                        self.expert_tensor_parallel, self.context_parallel)

    @property
    def packed(self) -> bool:
        """Micro-batches run as packed sequences (THD): asked for, or needed by context parallelism."""
        return self.pack_sequences or self.context_parallel > 1

    @property
    def router(self) -> RouterOptions:
        return RouterOptions(self.moe_aux_loss_coeff, self.moe_z_loss_coeff, self.moe_capacity_factor)

    @property
    def params_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def micro_batch_multiple(self) -> int:
        """What a per-rank batch must be a multiple of: micro_batch_size, or 1 under a token budget."""
        return 1 if self.max_tokens_per_micro_batch is not None else self.micro_batch_size


def check_precision(value: Any) -> str:
    if value not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {value!r}")
    return value
