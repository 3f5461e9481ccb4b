"""A researcher's own KL term in the actor's loss: ``kl_loss_fn(actor_outputs, ref_outputs, step)``.

    def dynamic_kl_loss(actor_outputs, ref_outputs, step, total_steps=1000):
        beta = linear_schedule(0.2, 0.02, step, total_steps)
        return beta * torch.mean(actor_outputs.logprobs - ref_outputs.logprobs)

The function sees each policy's log-probs as a ``PolicyOutputs``: ``logprobs`` holds the log-probs of
the micro-batch's valid response tokens only (1-D, row by row), so ``torch.mean`` over it is the token
mean and padding never dilutes it; ``token_logprobs`` and ``response_mask`` ([B, T], 0 off the mask)
are there for per-sequence terms. What it returns is read as:

- a scalar: a mean over the micro-batch's valid tokens (as above); the update weighs it by the
  micro-batch's share of the mini-batch's tokens, so the micro-batches and DP ranks add up to the
  mini-batch's token mean;
- a tensor like ``logprobs`` (one value per valid token) or like ``token_logprobs`` ([B, T]): a
  per-token term, aggregated like the policy loss (``ppo.loss_agg_mode``).

The weight is the function's own: the term enters the loss as returned.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.policy_losses import LossNormalizer, agg_loss, zero_padding

__all__ = ["PolicyOutputs", "UserKLTerm", "check_kl_loss_fn"]


@dataclass(frozen=True)
class PolicyOutputs:
    """One policy's log-probs on a micro-batch, as a user's KL function reads them."""

    token_logprobs: torch.Tensor  # [B, T], 0 where response_mask is 0
    response_mask: torch.Tensor  # [B, T], 1 on the model's response tokens

    @classmethod
    def of(cls, token_logprobs: torch.Tensor, response_mask: torch.Tensor) -> "PolicyOutputs":
        return cls(zero_padding(token_logprobs, response_mask), response_mask)

    @property
    def logprobs(self) -> torch.Tensor:
        """[N]: the log-probs of the N valid response tokens, row by row."""
        return self.token_logprobs[self.response_mask != 0]


def check_kl_loss_fn(fn: Callable) -> Callable:
    """``fn`` if it can be called as ``fn(actor_outputs, ref_outputs, step)``; TypeError naming it otherwise."""
    if not callable(fn):
        raise TypeError(f"kl_loss_fn must be a function (actor_outputs, ref_outputs, step) -> loss, got {fn!r}")
    try:
        inspect.signature(fn).bind(None, None, 0)
    except TypeError as exc:
        raise TypeError(f"kl_loss_fn {getattr(fn, '__name__', fn)!r} must accept (actor_outputs, ref_outputs, step): "
                        f"{exc}") from None
    except ValueError:  # a builtin without a signature: trust it
        pass
    return fn


@dataclass(frozen=True)
class UserKLTerm:
    """The user's KL function and the step it is called with, carried by the update's loss terms."""

    fn: Callable
    step: int = 0

    def __call__(self, log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor, agg_mode: str,
                 normalizer: LossNormalizer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the term, and shares of its statistics: ``kl_div`` (the token mean of
        log pi - log ref), ``kl_loss`` (the term) and ``kl_unit_loss`` (the term where log pi = log ref + 1,
        which is the coefficient of any term linear in the KL: the trainer's ``beta`` when ``kl_div`` is 0)."""
        actor, ref = PolicyOutputs.of(log_prob, mask), PolicyOutputs.of(ref_log_prob.to(log_prob.dtype), mask)
        share = mask.sum() / normalizer.tokens
        loss = self._as_share(self.fn(actor, ref, self.step), mask, agg_mode, normalizer, share)
        with torch.no_grad():
            unit = PolicyOutputs.of(ref.token_logprobs + 1.0, mask)
            unit_loss = self._as_share(self.fn(unit, ref, self.step), mask, agg_mode, normalizer, share)
            kl_div = ((actor.token_logprobs - ref.token_logprobs) * mask).sum() / normalizer.tokens
        return loss, {"kl_div": kl_div.detach(), "kl_loss": loss.detach(), "kl_unit_loss": unit_loss.detach()}

    @staticmethod
    def _as_share(value, mask, agg_mode, normalizer, share) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"kl_loss_fn must return a tensor (a scalar, or one value per token), got {value!r}")
        if value.dim() == 0:
            return value * share
        if value.shape == mask.shape:
            return agg_loss(value, mask, agg_mode, normalizer)
        valid = mask != 0
        if value.dim() == 1 and value.numel() == int(valid.sum()):
            per_token = torch.zeros(mask.shape, dtype=value.dtype, device=value.device).masked_scatter(valid, value)
            return agg_loss(per_token, mask, agg_mode, normalizer)
        raise ValueError(f"kl_loss_fn returned shape {tuple(value.shape)}; valid: a scalar, [{int(valid.sum())}] "
                         f"(one per valid token, like .logprobs) or {tuple(mask.shape)} (like .token_logprobs)")
