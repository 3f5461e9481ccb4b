"""PPO losses as pure tensor functions: the policy surrogate, the value loss, KL estimators.

Everything works on [batch, response_length] tensors with a response mask.
Aggregation is written so that micro-batches and data-parallel ranks add up
to the mean over the whole mini-batch: each call gets the mini-batch's
global token and sequence counts and returns its own share of the mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "LossNormalizer",
    "agg_loss",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "value_loss",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


@dataclass(frozen=True)
class LossNormalizer:
    """Counts over the whole mini-batch (all micro-batches, all DP ranks) that a mean divides by."""

    tokens: float
    sequences: float


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: LossNormalizer | None = None) -> torch.Tensor:
    """This batch's share of the mini-batch mean of ``loss`` under aggregation ``mode``.

    token-mean: every response token weighs the same. seq-mean-token-mean:
    each sequence's token mean, then the mean over sequences.
    seq-mean-token-sum: each sequence's token sum, then the mean over
    sequences. Without a normalizer the batch is the whole mini-batch.
    """
    mask = mask.to(loss.dtype)
    if normalizer is None:
        normalizer = LossNormalizer(tokens=float(mask.sum().clamp(min=1)), sequences=float(loss.shape[0]))
    if mode == "token-mean":
        return (loss * mask).sum() / normalizer.tokens
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normalizer.sequences
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum() / normalizer.sequences
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {LOSS_AGG_MODES}")


def _k1(log_prob, ref_log_prob):
    return log_prob - ref_log_prob


def _k2(log_prob, ref_log_prob):
    return 0.5 * (log_prob - ref_log_prob).square()


def _k3(log_prob, ref_log_prob):
    # Schulman's unbiased, low-variance estimator: exp(r) - r - 1 with r = log(ref/pi) >= its k1.
    log_ratio = (ref_log_prob - log_prob).clamp(-20, 20)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str | Callable = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate; ``estimator`` is k1, k2, k3 or a function of the two."""
    if callable(estimator):
        return estimator(log_prob, ref_log_prob)
    try:
        return KL_ESTIMATORS[estimator](log_prob, ref_log_prob)
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {sorted(KL_ESTIMATORS)} or a callable") from None


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    agg_mode: str = "token-mean",
    normalizer: LossNormalizer | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with the dual clip of Ye et al. 2020.

    For negative advantages the dual clip bounds the loss by -A * clip_ratio_c,
    so a huge ratio cannot blow up one update. ``clip_ratio_c=None`` turns it off.
    Returns the loss share and detached statistics (masked means over this batch).
    """
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.clamp(-20, 20).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    surrogate = torch.maximum(unclipped, clipped)
    stats = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
        bound = -advantages * clip_ratio_c
        dual = torch.minimum(surrogate, bound)
        stats["pg_clipfrac_lower"] = masked_mean(((surrogate > bound) & (advantages < 0)).float(), mask).detach()
        surrogate = torch.where(advantages < 0, dual, surrogate)
    return agg_loss(surrogate, mask, agg_mode, normalizer), stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range_value: float = 0.5,
    agg_mode: str = "token-mean",
    normalizer: LossNormalizer | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
    clipped_values = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    stats = {"vf_clipfrac": masked_mean((clipped_loss > unclipped_loss).float(), mask).detach()}
    return agg_loss(loss, mask, agg_mode, normalizer), stats
