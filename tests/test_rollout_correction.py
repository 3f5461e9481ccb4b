"""Rollout correction (TIS / MIS) weights, masks, metrics and loss against values worked out by hand.

The rollout log-probs are the trainer's old log-probs deliberately perturbed, so that the token ratios
r = p_train / p_rollout are 3, 0.5, 1 (sequence 0) and 1.5, 0.25 (sequence 1, whose third token is padding).
"""

import math

import pytest
import torch

from workers.policy_losses import LossNormalizer, PolicyLossSpec, compute_policy_loss
from workers.rollout_correction import RolloutCorrection, correction_metrics, correction_weights

RATIOS = [[3.0, 0.5, 1.0], [1.5, 0.25, 7.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]])
ROLLOUT = OLD - torch.tensor(RATIOS).log()  # log r = old - rollout


def weights(**config):
    return correction_weights(OLD, ROLLOUT, MASK, RolloutCorrection(**config))


def test_truncated_is_per_token_and_per_sequence():
    w, ind = weights(mode="tis", level="token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0], [1.5, 0.25, 0.0]]))
    assert ind["truncated"].tolist() == [[True, False, False], [False, False, False]]
    # sequence level: the product of the token ratios, on every token of the sequence
    w, ind = weights(mode="tis", level="sequence", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [0.375, 0.375, 0.0]]))
    assert not ind["truncated"].any()
    w, ind = weights(mode="tis", level="sequence", cap=1.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [0.375, 0.375, 0.0]]))
    assert ind["truncated"].sum() == 3


def test_masked_is_drops_tokens_or_whole_sequences():
    w, ind = weights(mode="mis", level="token", low=0.5, high=2.0)  # 3 and 0.25 fall outside; 0.5 is the bound
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    assert ind["masked"].tolist() == [[True, False, False], [False, True, False]]
    # sequence level, geometric means: 1.5^(1/3) = 1.145 (kept) and 0.375^(1/2) = 0.612 (below 0.7: dropped)
    w, ind = weights(mode="mis", level="sequence", low=0.7, high=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert ind["masked"].sum() == 2
    w, _ = weights(mode="off")
    torch.testing.assert_close(w, MASK.float())


def test_metrics_by_hand_and_micro_batch_shares_add_up():
    norm = LossNormalizer(tokens=5.0, sequences=2.0)
    w, ind = weights(mode="tis", level="token", cap=2.0)
    stats = correction_metrics(OLD, ROLLOUT, MASK, norm, w, ind)
    r = [3.0, 0.5, 1.0, 1.5, 0.25]
    assert stats["kl_k1"].item() == pytest.approx(-sum(math.log(x) for x in r) / 5, rel=1e-5)
    assert stats["kl_k3"].item() == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 5, rel=1e-5)
    assert stats["chi2"].item() == pytest.approx(sum(x * x for x in r) / 5 - 1, rel=1e-5)
    assert stats["ppl_ratio"].item() == pytest.approx((1.5 ** (-1 / 3) + 0.375 ** (-1 / 2)) / 2, rel=1e-5)
    assert stats["weight_mean"].item() == pytest.approx((2 + 0.5 + 1 + 1.5 + 0.25) / 5, rel=1e-6)
    assert stats["truncated_frac"].item() == pytest.approx(1 / 5)
    assert stats["masked_frac"].item() == 0.0
    parts = [correction_metrics(OLD[i : i + 1], ROLLOUT[i : i + 1], MASK[i : i + 1], norm, w[i : i + 1],
                                {k: v[i : i + 1] for k, v in ind.items()}) for i in range(2)]
    for key, value in stats.items():
        assert sum(p[key] for p in parts).item() == pytest.approx(value.item(), rel=1e-6)


def test_the_weights_scale_the_policy_loss():
    # The update's ratio is 1 (new = old) and every advantage 1: each token's PPO loss is -1, times its weight.
    w, _ = weights(mode="tis", level="token", cap=2.0)
    loss, _ = compute_policy_loss(PolicyLossSpec(), OLD, OLD.clone(), torch.ones(2, 3), MASK, weights=w)
    assert loss.item() == pytest.approx(-(2 + 0.5 + 1 + 1.5 + 0.25) / 5, rel=1e-6)
    w, _ = weights(mode="mis", level="token")
    loss, _ = compute_policy_loss(PolicyLossSpec(), OLD, OLD.clone(), torch.ones(2, 3), MASK, weights=w)
    assert loss.item() == pytest.approx(-(0 + 1 + 1 + 1 + 0) / 5, rel=1e-6)  # masked tokens still count in the mean


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match=r"mode 'is' is not one of \('off', 'tis', 'mis'\)"):
        RolloutCorrection(mode="is")
    with pytest.raises(ValueError, match=r"level 'batch' is not one of \('token', 'sequence'\)"):
        RolloutCorrection(level="batch")
    with pytest.raises(ValueError, match="cap must be > 0"):
        RolloutCorrection(cap=0)
    with pytest.raises(ValueError, match="0 <= low < 1 < high, got low 1.2 and high 2.0"):
        RolloutCorrection(low=1.2)
