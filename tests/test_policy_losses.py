"""Policy and value losses against values worked out by hand."""

import math

import pytest
import torch

from workers.policy_losses import (
    LossNormalizer,
    PolicyLossSpec,
    agg_loss,
    cispo_loss,
    compute_policy_loss,
    gspo_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    # Dr. GRPO: token sums over one constant, the response width (3) or the given maximum length (8)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 + 4) / (2 * 3))
    norm = LossNormalizer(tokens=4.0, sequences=2.0, norm_length=8.0)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", norm).item() == pytest.approx((6 + 4) / (2 * 8))
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        agg_loss(loss, mask, "mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
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
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; valid: k1, k2, k3, kl, mse, low_var_kl, k1\+"):
        kl_penalty(logp, ref, "k4")


@pytest.mark.parametrize("name,value", [("k1+", lambda d: d), ("k3+", lambda d: math.exp(-d) + d - 1),
                                        ("low_var_kl+", lambda d: math.exp(-d) + d - 1), ("k2+", lambda d: d * d / 2)])
def test_a_plus_estimator_is_its_value_with_k2s_gradient(name, value):
    """verl's straight-through forms: the estimator's value; the gradient of k2 = (log pi - log ref)^2 / 2, which is
    log pi - log ref per token (Schulman's note: on samples of pi, k2's gradient is the KL's in expectation)."""
    logp = torch.tensor([-0.3, -1.2, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.9, -1.0, -0.5], dtype=torch.float64)
    kl = kl_penalty(logp, ref, name)
    delta = (logp - ref).detach()
    assert kl.tolist() == pytest.approx([value(d) for d in delta.tolist()], rel=1e-12)
    kl.sum().backward()
    assert logp.grad.tolist() == pytest.approx(delta.tolist(), rel=1e-12)
    plain = torch.tensor(logp.detach().tolist(), dtype=torch.float64, requires_grad=True)
    kl_penalty(plain, ref, name.rstrip("+")).sum().backward()  # without the "+", its own gradient
    assert name == "k2+" or plain.grad.tolist() != pytest.approx(delta.tolist(), rel=1e-6)


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


def test_per_token_weights_scale_the_loss_before_aggregation():
    old, new = torch.zeros(1, 3), torch.log(torch.tensor([[1.1, 1.0, 0.9]]))
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    weights = torch.tensor([[0.5, 2.0, 0.0]])
    loss, _ = policy_loss(old, new, adv, mask, weights=weights)
    assert loss.item() == pytest.approx((-1.1 * 0.5 - 1.0 * 2.0 - 0.0) / 3)


def test_gspo_clips_the_sequence_ratio():
    # sequence 0: token ratios 1.2 and 1.0 -> s = sqrt(1.2) = 1.0954, A = +1: clipped to 1 + 4e-4
    # sequence 1: one token of ratio 0.9999 (the second is padding), A = -1: inside [1 - 3e-4, 1 + 4e-4]
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[1.2, 1.0], [0.9999, 5.0]]))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = gspo_loss(old, new, adv, mask)
    assert loss.item() == pytest.approx((-(1 + 4e-4) + 0.9999) / 2, abs=1e-6)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 3)
    same, _ = compute_policy_loss(PolicyLossSpec("gspo", 3e-4, 4e-4, agg_mode="seq-mean-token-mean"), old, new, adv, mask)
    assert same.item() == loss.item()


def test_gspo_and_gspo_token_gradients():
    # One sequence, token ratios 1.1 and 0.9: s = sqrt(0.99); wide clip ranges, nothing clipped.
    s = math.sqrt(0.99)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    grads = {}
    for token_level in (False, True):
        for name, adv in (("flat", torch.tensor([[2.0, 2.0]])), ("varied", torch.tensor([[1.0, 3.0]]))):
            new = torch.log(torch.tensor([[1.1, 0.9]])).requires_grad_()
            loss, _ = gspo_loss(old, new, adv, mask, 0.2, 0.2, token_level=token_level)
            assert loss.item() == pytest.approx(-adv.mean().item() * s, rel=1e-6)  # the same value either way
            loss.backward()
            grads[token_level, name] = new.grad[0].tolist()
    # GSPO: d/d log p_t of -mean(A) * s = -mean(A) * s / |y|; GSPO-token: -A_t * s / |y|
    assert grads[False, "varied"] == pytest.approx([-2 * s / 2, -2 * s / 2], rel=1e-6)
    assert grads[True, "varied"] == pytest.approx([-1 * s / 2, -3 * s / 2], rel=1e-6)
    assert grads[False, "flat"] == pytest.approx(grads[True, "flat"], rel=1e-6)  # one advantage per sequence


def test_cispo_keeps_a_gradient_on_every_token():
    ratio = torch.tensor([[1.5, 7.0, 0.5]])
    old = torch.zeros(1, 3)
    new = ratio.log().requires_grad_()
    adv, mask = torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3)
    loss, stats = cispo_loss(old, new, adv, mask)  # ratio clipped to [0, 5]
    expected = (-1.5 * math.log(1.5) - 5.0 * math.log(7.0) + 0.5 * math.log(0.5)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["pg_clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d/d log p_t of -sg[clip(r_t)] * A_t * log p_t: the clipped token (7 -> 5) keeps its gradient
    assert new.grad[0].tolist() == pytest.approx([-1.5 / 3, -5.0 / 3, 0.5 / 3], rel=1e-6)
    ppo_new = ratio.log().requires_grad_()
    policy_loss(old, ppo_new, adv, mask, clip_ratio_c=None)[0].backward()
    assert ppo_new.grad[0, 1].item() == 0.0  # PPO's clip zeroes it


def test_policy_loss_spec_names_bad_values():
    with pytest.raises(ValueError, match=r"policy loss 'trpo' is not one of \('ppo', 'gspo', 'gspo_token', 'cispo'\)"):
        PolicyLossSpec("trpo")
    with pytest.raises(ValueError, match="loss_agg_mode 'sum' is not one of"):
        PolicyLossSpec(agg_mode="sum")
    with pytest.raises(ValueError, match="clip ranges must be >= 0"):
        PolicyLossSpec(clip_ratio_low=-0.1)
