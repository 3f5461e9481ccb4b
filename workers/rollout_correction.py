"""Rollout correction: importance weights between the rollout engine's log-probs and the trainer's.

The rollout engine samples from its own kernels (and, off-policy, from older weights); the trainer
scores the same tokens with its own. The ratio w_t = pi_train(y_t) / pi_rollout(y_t), computed from the
old log-probs the update's ratio starts from, corrects the policy loss for that mismatch:

- ``tis`` (truncated importance sampling): the weight, capped at ``cap``. At ``token`` level each
  token's own ratio; at ``sequence`` level the sequence's product of ratios, the likelihood ratio of
  the whole response, on every token of it.
- ``mis`` (masked importance sampling): tokens, or whole sequences, whose ratio falls outside
  [``low``, ``high``] get weight 0; the others weight 1. A sequence's ratio here is the geometric mean
  of its token ratios (a product's range grows with the length, so fixed bounds would mean nothing).
  A masked token still counts in the loss's denominator, so the step size does not jump with the
  number masked.

The weights are detached: they scale each token's policy loss and carry no gradient.
``correction_metrics`` reports the mismatch as KL(rollout || train) (the k1 and k3 estimators), the
perplexity ratio and the chi-square divergence, each as this micro-batch's share of the mini-batch
value, as the policy statistics are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.policy_losses import LossNormalizer, masked_mean, zero_padding

__all__ = ["CORRECTION_LEVELS", "CORRECTION_MODES", "RolloutCorrection", "correction_metrics", "correction_weights"]

CORRECTION_MODES = ("off", "tis", "mis")
CORRECTION_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class RolloutCorrection:
    mode: str = "off"  # one of CORRECTION_MODES
    level: str = "token"  # one of CORRECTION_LEVELS
    cap: float = 2.0  # tis: weights above it are truncated to it
    low: float = 0.5  # mis: the ratio's lower bound
    high: float = 2.0  # mis: the ratio's upper bound

    def __post_init__(self) -> None:
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"rollout correction mode {self.mode!r} is not one of {CORRECTION_MODES}")
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(f"rollout correction level {self.level!r} is not one of {CORRECTION_LEVELS}")
        if self.cap <= 0:
            raise ValueError(f"rollout correction cap must be > 0, got {self.cap}")
        if not 0 <= self.low < 1 < self.high:
            raise ValueError(f"rollout correction bounds must satisfy 0 <= low < 1 < high, got low {self.low} "
                             f"and high {self.high}")

    @property
    def on(self) -> bool:
        return self.mode != "off"


def correction_weights(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, config: RolloutCorrection
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights [B, T] (detached, 0 on padding) and the per-token indicators of what they did.

    The indicators: ``truncated`` (tis: the weight was capped) and ``masked`` (mis: the weight is 0).
    """
    mask = mask.to(old_log_prob.dtype)
    log_ratio = zero_padding(old_log_prob.detach().float() - rollout_log_prob.float(), mask) * mask
    zeros = torch.zeros_like(log_ratio, dtype=torch.bool)
    if config.mode == "tis":
        if config.level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        raw = log_ratio.clamp(-20, 20).exp()
        truncated = (raw > config.cap) & mask.bool()
        return raw.clamp(max=config.cap) * mask, {"truncated": truncated, "masked": zeros}
    if config.mode == "mis":
        if config.level == "sequence":
            log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
        ratio = log_ratio.clamp(-20, 20).exp()
        masked = ((ratio < config.low) | (ratio > config.high)) & mask.bool()
        return (~masked).to(mask.dtype) * mask, {"truncated": zeros, "masked": masked}
    return mask.clone(), {"truncated": zeros, "masked": zeros}


def correction_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    normalizer: LossNormalizer,
    weights: torch.Tensor | None = None,
    indicators: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """This micro-batch's shares of the mini-batch's ``rollout_corr/`` statistics.

    Token means (over the mini-batch's response tokens): ``kl_k1`` = E[log q - log p] and
    ``kl_k3`` = E[r - 1 - log r], r = p / q, both estimating KL(rollout q || train p) from q's samples;
    ``chi2`` = E[r^2] - 1, the chi-square divergence; with weights, ``weight_mean`` and the fractions
    ``truncated_frac`` and ``masked_frac``. Sequence mean: ``ppl_ratio``, each sequence's training
    perplexity over its rollout perplexity.
    """
    mask = mask.to(torch.float32)
    log_ratio = zero_padding(old_log_prob.detach().float() - rollout_log_prob.float(), mask) * mask
    ratio = log_ratio.clamp(-20, 20).exp()

    def token_share(values: torch.Tensor) -> torch.Tensor:
        return (zero_padding(values, mask) * mask).sum() / normalizer.tokens

    stats = {
        "kl_k1": token_share(-log_ratio),
        "kl_k3": token_share(ratio - 1 - log_ratio),
        "chi2": token_share(ratio.square() - 1),
        # perplexity exp(-mean log p) per sequence: train over rollout = exp(-mean_t log r)
        # a row with no valid token is no sequence (it is not counted in normalizer.sequences either)
        "ppl_ratio": (-masked_mean(log_ratio, mask, dim=-1)).exp()[(mask != 0).any(-1)].sum() / normalizer.sequences,
    }
    if weights is not None:
        stats["weight_mean"] = token_share(weights.float())
        stats["truncated_frac"] = token_share(indicators["truncated"].float())
        stats["masked_frac"] = token_share(indicators["masked"].float())
    return {key: value.detach() for key, value in stats.items()}
