"""Policy-gradient losses as pure tensor functions: the policy objectives, the value loss, KL estimators.

Everything works on [batch, response_length] tensors with a response mask.
Aggregation is written so that micro-batches and data-parallel ranks add up
to the mean over the whole mini-batch: each call gets the mini-batch's
global token and sequence counts and returns its own share of the mean.

The policy objectives (``POLICY_LOSSES``, chosen by ``PolicyLossSpec.kind``):
- ``ppo``: the clipped token-ratio surrogate, decoupled clip ranges, dual clip;
- ``gspo``: GSPO's sequence-level ratio (the geometric mean of the token ratios), clipped per sequence;
- ``gspo_token``: GSPO-token, the sequence ratio's value with each token's own gradient path;
- ``cispo``: REINFORCE on log-probs weighted by clipped, stop-gradient importance ratios.
Each takes an optional per-token ``weights`` tensor (rollout correction), detached, that scales the
per-token loss before aggregation.

Padded positions (mask 0) may hold anything, NaN and inf included: every function here selects the
valid positions with ``torch.where`` before any arithmetic (``x * mask`` would turn NaN into NaN), so a
loss, its gradient and every statistic equal those of the same batch with zeros in the padding. A row
with no valid token does not count as a sequence in the ``seq-mean-*`` modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "LOSS_AGG_MODES",
    "KL_ALIASES",
    "KL_ESTIMATORS",
    "KL_ESTIMATOR_NAMES",
    "POLICY_LOSSES",
    "LossNormalizer",
    "PolicyLossSpec",
    "agg_loss",
    "cispo_loss",
    "compute_policy_loss",
    "gspo_loss",
    "kl_loss",
    "kl_estimator",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "valid_sequences",
    "value_loss",
    "zero_padding",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo", "gspo", "gspo_token", "cispo")


def zero_padding(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` with 0 wherever ``mask`` is 0; whatever a padded position held (NaN, inf) is not read,
    and no gradient flows to it."""
    return torch.where(mask != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))


def valid_sequences(mask: torch.Tensor) -> torch.Tensor:
    """The number of rows of a [B, T] mask with at least one valid token: the sequences a
    ``seq-mean-*`` mean counts (a fully masked row has no tokens to average)."""
    return (mask != 0).any(-1).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is non-zero (weighted by it); 0 with none."""
    mask = mask.to(values.dtype)
    values = zero_padding(values, mask)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


@dataclass(frozen=True)
class LossNormalizer:
    """Counts over the whole mini-batch (all micro-batches, all DP ranks) that a mean divides by.

    ``norm_length``: the constant that ``seq-mean-token-sum-norm`` divides each sequence's token sum by
    (Dr. GRPO: the maximum response length); None where no mode needs it.
    """

    tokens: float
    sequences: float
    norm_length: float | None = None


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: LossNormalizer | None = None) -> torch.Tensor:
    """This batch's share of the mini-batch mean of ``loss`` under aggregation ``mode``.

    token-mean: every response token weighs the same. seq-mean-token-mean:
    each sequence's token mean, then the mean over sequences.
    seq-mean-token-sum: each sequence's token sum, then the mean over
    sequences. seq-mean-token-sum-norm (Dr. GRPO): each sequence's token sum
    divided by one constant, ``normalizer.norm_length`` (the maximum response
    length; without it, the width of ``loss``), then the mean over sequences:
    no sequence's tokens weigh more for being short. The sequences counted are
    those with a valid token (``valid_sequences``). Without a normalizer the
    batch is the whole mini-batch.
    """
    mask = mask.to(loss.dtype)
    loss = zero_padding(loss, mask)
    if normalizer is None:
        normalizer = LossNormalizer(tokens=float(mask.sum().clamp(min=1)),
                                    sequences=float(valid_sequences(mask).clamp(min=1)))
    if mode == "token-mean":
        return (loss * mask).sum() / normalizer.tokens
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normalizer.sequences
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum() / normalizer.sequences
    if mode == "seq-mean-token-sum-norm":
        length = normalizer.norm_length if normalizer.norm_length is not None else loss.shape[-1]
        return (loss * mask).sum() / (normalizer.sequences * length)
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
#: verl's (and TRL's) other names for the estimators.
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
#: Every estimator name: k1, k2, k3, the aliases, and each with verl's "+" (the value, with k2's gradient).
KL_ESTIMATOR_NAMES = tuple(f"{name}{plus}" for plus in ("", "+") for name in (*KL_ESTIMATORS, *KL_ALIASES))


def _straight_through(estimator):
    """``estimator``'s value with k2's gradient. k1 and k3 estimate KL(pi || ref) without bias, but their
    gradients do not estimate its gradient; on samples from pi, k2's gradient, (log pi - log ref) grad log pi,
    does (Schulman, "Approximating KL divergence"; verl's "k3+")."""

    def kl(log_prob, ref_log_prob):
        gradient = _k2(log_prob, ref_log_prob)
        return gradient - gradient.detach() + estimator(log_prob, ref_log_prob).detach()

    return kl


def kl_estimator(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The per-token estimator called ``name`` (one of KL_ESTIMATOR_NAMES); a ValueError naming the valid ones."""
    base, plus = (name[:-1], True) if isinstance(name, str) and name.endswith("+") else (name, False)
    base = KL_ALIASES.get(base, base)
    if base not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; valid: {', '.join(KL_ESTIMATOR_NAMES)} or a callable")
    return _straight_through(KL_ESTIMATORS[base]) if plus else KL_ESTIMATORS[base]


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str | Callable = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate; ``estimator`` is one of KL_ESTIMATOR_NAMES or a function of the two."""
    if callable(estimator):
        return estimator(log_prob, ref_log_prob)
    return kl_estimator(estimator)(log_prob, ref_log_prob)


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    estimator: str | Callable = "k3",
    agg_mode: str = "token-mean",
    normalizer: LossNormalizer | None = None,
) -> torch.Tensor:
    """This batch's share of the KL(pi || ref) loss term: ``kl_penalty`` per token, aggregated like the
    policy loss. Both log-probs are read on valid positions only, so neither the term nor its gradient
    sees what the padding holds."""
    log_prob, ref_log_prob = zero_padding(log_prob, mask), zero_padding(ref_log_prob, mask)
    return agg_loss(kl_penalty(log_prob, ref_log_prob, estimator), mask, agg_mode, normalizer)


def _clipped_surrogate(ratio, log_ratio, advantages, mask, clip_ratio_low, clip_ratio_high):
    """max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high)) per token, the clip fraction and the PPO KL."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    stats = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return torch.maximum(unclipped, clipped), stats


def _weighted(loss: torch.Tensor, weights: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    return loss if weights is None else loss * zero_padding(weights.detach(), mask)


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
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with the dual clip of Ye et al. 2020.

    ``clip_ratio_low`` / ``clip_ratio_high`` are decoupled (DAPO's clip-higher raises the second).
    For negative advantages the dual clip bounds the loss by -A * clip_ratio_c,
    so a huge ratio cannot blow up one update. ``clip_ratio_c=None`` turns it off.
    Returns the loss share and detached statistics (masked means over this batch).
    """
    old_log_prob, log_prob, advantages = (zero_padding(t, mask) for t in (old_log_prob, log_prob, advantages))
    log_ratio = log_prob - old_log_prob
    surrogate, stats = _clipped_surrogate(log_ratio.clamp(-20, 20).exp(), log_ratio, advantages, mask,
                                          clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
        bound = -advantages * clip_ratio_c
        dual = torch.minimum(surrogate, bound)
        stats["pg_clipfrac_lower"] = masked_mean(((surrogate > bound) & (advantages < 0)).float(), mask).detach()
        surrogate = torch.where(advantages < 0, dual, surrogate)
    return agg_loss(_weighted(surrogate, weights, mask), mask, agg_mode, normalizer), stats


def gspo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    agg_mode: str = "seq-mean-token-mean",
    normalizer: LossNormalizer | None = None,
    token_level: bool = False,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): the importance ratio of a whole sequence, clipped per sequence.

    s_i = exp(mean_t (log pi(y_t) - log pi_old(y_t))), the geometric mean of the token ratios;
    each token's loss is max(-A * s_i, -A * clip(s_i, 1 - low, 1 + high)), with the paper's small
    ranges (3e-4, 4e-4) by default. ``token_level`` (GSPO-token): s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)],
    equal to s_i in value, so each token's gradient follows its own advantage; with one advantage
    per sequence both variants have the same gradient.
    """
    old_log_prob, log_prob, advantages = (zero_padding(t, mask) for t in (old_log_prob, log_prob, advantages))
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)  # [B, 1]
    if token_level:
        log_s = seq_log_ratio.detach() + log_prob - log_prob.detach()
    else:
        log_s = seq_log_ratio.expand_as(log_prob)
    surrogate, stats = _clipped_surrogate(log_s.clamp(max=10.0).exp(), log_ratio, advantages, mask,
                                          clip_ratio_low, clip_ratio_high)
    return agg_loss(_weighted(surrogate, weights, mask), mask, agg_mode, normalizer), stats


def cispo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 1.0,
    clip_ratio_high: float = 4.0,
    agg_mode: str = "token-mean",
    normalizer: LossNormalizer | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): -sg[clip(r_t, 1 - low, 1 + high)] * A_t * log pi(y_t).

    The importance ratio r_t = pi / pi_old is clipped and detached, so it only weights the
    REINFORCE term and every token keeps its gradient (PPO's clip zeroes the gradient of clipped
    tokens). The defaults: no lower bound (low 1 gives 0) and an upper bound of 5.
    """
    old_log_prob, log_prob, advantages = (zero_padding(t, mask) for t in (old_log_prob, log_prob, advantages))
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.detach().clamp(-20, 20).exp()
    clipped_ratio = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    surrogate = -clipped_ratio * advantages * log_prob
    stats = {
        "pg_clipfrac": masked_mean((clipped_ratio != ratio).float(), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return agg_loss(_weighted(surrogate, weights, mask), mask, agg_mode, normalizer), stats


@dataclass(frozen=True)
class PolicyLossSpec:
    """Which policy objective an update minimizes, with its clip ranges and aggregation."""

    kind: str = "ppo"  # one of POLICY_LOSSES
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0  # ppo's dual clip; None turns it off
    agg_mode: str = "token-mean"  # one of LOSS_AGG_MODES

    def __post_init__(self) -> None:
        if self.kind not in POLICY_LOSSES:
            raise ValueError(f"policy loss {self.kind!r} is not one of {POLICY_LOSSES}")
        if self.agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.agg_mode!r} is not one of {LOSS_AGG_MODES}")
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError(f"clip ranges must be >= 0, got low {self.clip_ratio_low} and high {self.clip_ratio_high}")


def compute_policy_loss(
    spec: PolicyLossSpec,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: LossNormalizer | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss share and statistics of ``spec``'s objective."""
    common = dict(agg_mode=spec.agg_mode, normalizer=normalizer, weights=weights)
    if spec.kind == "ppo":
        return policy_loss(old_log_prob, log_prob, advantages, mask, spec.clip_ratio_low, spec.clip_ratio_high,
                           spec.clip_ratio_c, **common)
    if spec.kind in ("gspo", "gspo_token"):
        return gspo_loss(old_log_prob, log_prob, advantages, mask, spec.clip_ratio_low, spec.clip_ratio_high,
                         token_level=spec.kind == "gspo_token", **common)
    return cispo_loss(old_log_prob, log_prob, advantages, mask, spec.clip_ratio_low, spec.clip_ratio_high, **common)


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
    values, old_values, returns = (zero_padding(t, mask) for t in (values, old_values, returns))
    clipped_values = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    stats = {"vf_clipfrac": masked_mean((clipped_loss > unclipped_loss).float(), mask).detach()}
    return agg_loss(loss, mask, agg_mode, normalizer), stats
