"""A mixture of experts' padding, handed to its MoE layers: the routers leave it out of their losses.

megatron-core's routers take a ``padding_mask`` and then compute the load-balancing and z-losses (and the
expert bias's counts) over the real tokens only. ``GPTModel.forward`` accepts that mask, but megatron-core
0.16 splits it for sequence parallelism with the global tensor-parallel group, which a job of explicit
process groups never creates, and hands a later pipeline stage's layers the mask unsplit. So the engine gives
each MoE layer its micro-batch's mask itself, already cut to the sequence slice this rank routes: a forward
pre-hook on every ``MoELayer`` of the stage fills in ``padding_mask`` while a micro-batch's forward runs.

The load-balancing loss is then exactly the real tokens' at any layout. megatron's z-loss is, under sequence
parallelism, the mean of each TP rank's own mean over its real tokens: exact when the ranks hold as many
(always, without padding), close otherwise.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["MoEPadding", "padding_mask"]


def padding_mask(valid: torch.Tensor, width: int, sequence_parallel: bool, tp_rank: int, tp: int) -> torch.Tensor:
    """[B, S'] (True: padding) for rows left-aligned in ``width`` columns with ``valid`` [B] real tokens each;
    S' is the whole width, or under sequence parallelism this TP rank's slice of it."""
    mask = torch.arange(width, device=valid.device).unsqueeze(0) >= valid.unsqueeze(1)
    if sequence_parallel:
        part = width // tp
        mask = mask[:, tp_rank * part:(tp_rank + 1) * part]
    return mask.contiguous()


class MoEPadding:
    """The MoE layers of ``module``; ``within(mask)`` runs a forward with ``mask`` as their padding."""

    def __init__(self, module: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.mask: torch.Tensor | None = None
        self.layers = [m for m in module.modules() if isinstance(m, MoELayer)]
        for layer in self.layers:
            layer.register_forward_pre_hook(self._fill, with_kwargs=True)

    def _fill(self, layer, args, kwargs):
        if self.mask is None:
            return None
        return args, {**kwargs, "padding_mask": self.mask}

    @contextmanager
    def within(self, mask: torch.Tensor) -> Iterator[None]:
        self.mask = mask
        try:
            yield
        finally:
            self.mask = None
