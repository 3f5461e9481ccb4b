"""PPO losses against values worked out by hand."""

import math

import pytest
import torch

from workers.policy_losses import LossNormalizer, agg_loss, kl_penalty, policy_loss, value_loss


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        agg_loss(loss, mask, "mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_shares_add_up_to_the_whole(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).long()
    mask[:, 0] = 1
    whole = agg_loss(loss, mask, mode)
    norm = LossNormalizer(tokens=float(mask.sum()), sequences=6.0)
    parts = sum(agg_loss(loss[i : i + 2], mask[i : i + 2], mode, norm) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_kl_estimators():
    logp, ref = torch.tensor([0.0]), torch.tensor([math.log(0.5)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert kl_penalty(logp, ref, lambda a, b: (a - b) * 2).item() == pytest.approx(2 * math.log(2))
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; valid: \['k1', 'k2', 'k3'\]"):
        kl_penalty(logp, ref, "k4")


def test_ppo_clip_and_dual_clip():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 1.5, 5.0]]))
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, stats = policy_loss(old, new, adv, mask, 0.2, 0.2, clip_ratio_c=3.0)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(1.5, 1.2) = 1.5; token 2: max(5, 1.2) = 5 -> dual clip 3
    assert loss.item() == pytest.approx((-1.2 + 1.5 + 3.0) / 3)
    assert stats["pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(1 / 3)
    assert stats["ppo_kl"].item() == pytest.approx(-(2 * math.log(1.5) + math.log(5)) / 3)
    no_dual, _ = policy_loss(old, new, adv, mask, 0.2, 0.2, clip_ratio_c=None)
    assert no_dual.item() == pytest.approx((-1.2 + 1.5 + 5.0) / 3)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(old, new, adv, mask, clip_ratio_c=0.5)


def test_ppo_gradient_is_zero_where_clipped():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = policy_loss(old, new, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
    loss.backward()
    assert new.grad[0, 0].item() == 0.0
    assert new.grad[0, 1].item() == pytest.approx(-1.1 / 2)


def test_clipped_value_loss():
    values, old, returns = torch.tensor([[1.0, 0.1]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 0.0]])
    loss, stats = value_loss(values, old, returns, torch.ones(1, 2), clip_range_value=0.5)
    # token 0: max((1-2)^2, (0.5-2)^2) = 2.25; token 1: max(0.01, 0.01) = 0.01
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.01) / 2)
    assert stats["vf_clipfrac"].item() == pytest.approx(0.5)
