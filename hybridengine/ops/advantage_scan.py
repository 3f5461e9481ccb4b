"""Backward scans over [batch, length] for advantage estimation.

Both scans skip a position with mask 0: it gets 0 in every output, the
later state passes through it unchanged, and whatever its inputs hold (NaN
and inf included) is never read. A row is therefore scanned as its
compacted row, the valid tokens alone: the observation tokens between the
turns of a multi-turn response do not cut a return or an advantage.

``gae_scan``: generalised advantage estimation; the value after a
sequence's last valid token is 0. ``discounted_returns``: the reward-to-go
G_t = r_t + gamma G_{t'}, t' the next valid position (the sum of the future
rewards the papers define). A fractional mask m passes the later state
through in proportion 1 - m.

Both run as one kernel (rows in parallel) when the op library is built, as a
torch loop over the length otherwise; the loop is the reference the kernels
are tested against. Results are fp32.
"""

from __future__ import annotations

import torch

from hybridengine.ops.library import kernels_available, kernels_on

__all__ = ["discounted_returns", "discounted_returns_reference", "gae_scan", "gae_scan_reference"]


def _check(name: str, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if tensor.dim() != 2 or tensor.shape != like.shape:
        raise ValueError(f"{name} must be [batch, length] like the rewards {tuple(like.shape)}, "
                         f"got {tuple(tensor.shape)}")
    return tensor.float()


def gae_scan_reference(rewards, values, mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    next_adv = rewards.new_zeros(batch)
    advantages = torch.zeros_like(rewards)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        m = mask[:, t]
        valid = m != 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv_t * m, 0.0)
        returns[:, t] = torch.where(valid, (adv_t * m + values[:, t]) * m, 0.0)
        next_value = torch.where(valid, m * values[:, t] + (1 - m) * next_value, next_value)
        next_adv = torch.where(valid, m * adv_t + (1 - m) * next_adv, next_adv)
    return advantages, returns


def discounted_returns_reference(rewards, mask, gamma: float) -> torch.Tensor:
    batch, length = rewards.shape
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(batch)
    for t in reversed(range(length)):
        m = mask[:, t]
        valid = m != 0
        g_t = rewards[:, t] + gamma * running
        returns[:, t] = torch.where(valid, g_t * m, 0.0)
        running = torch.where(valid, m * g_t + (1 - m) * running, running)
    return returns


if kernels_available():

    @torch.library.register_fake("hybridflow::gae")
    def _(rewards, values, mask, gamma, lam):
        return rewards.new_empty(rewards.shape, dtype=torch.float32), rewards.new_empty(rewards.shape,
                                                                                        dtype=torch.float32)

    @torch.library.register_fake("hybridflow::discounted_returns")
    def _(rewards, mask, gamma):
        return rewards.new_empty(rewards.shape, dtype=torch.float32)


def gae_scan(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """(advantages, returns) [batch, length] fp32; returns = advantages + values on valid positions, 0 elsewhere."""
    rewards = _check("rewards", rewards, rewards)
    values, mask = _check("values", values, rewards), _check("mask", mask, rewards)
    if kernels_on(rewards.device):
        return torch.ops.hybridflow.gae(rewards, values, mask, float(gamma), float(lam))
    return gae_scan_reference(rewards, values, mask, float(gamma), float(lam))


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{t'} over valid positions (t' the next one), 0 on masked ones; [batch, length] fp32."""
    rewards = _check("rewards", rewards, rewards)
    mask = _check("mask", mask, rewards)
    if kernels_on(rewards.device):
        return torch.ops.hybridflow.discounted_returns(rewards, mask, float(gamma))
    return discounted_returns_reference(rewards, mask, float(gamma))
