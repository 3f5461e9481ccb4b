"""Masked positions are never read: padding and observation tokens may hold NaN or inf, and every loss,
gradient, advantage and metric equals the run with zeros there. A row with no valid token is no sequence."""

import itertools

import pytest
import torch

from controller.algorithms import AdvantageConfig, AdvantageInputs, apply_kl_penalty, compute_advantages, masked_whiten
from controller.rl.step_metrics import batch_metrics
from workers.data_proto import DataProto
from workers.megatron.ppo_update import normalizer_counts
from workers.policy_losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossNormalizer,
    PolicyLossSpec,
    agg_loss,
    compute_policy_loss,
    kl_loss,
    masked_mean,
    value_loss,
)
from workers.rollout_correction import RolloutCorrection, correction_metrics, correction_weights

B, T = 4, 7


def mask_with_gaps() -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 5:] = 0  # right padding
    mask[1, 2:4] = 0  # an observation between two turns
    mask[1, 6:] = 0
    mask[3, 1] = 0
    return mask


def tensors(seed: int, mask: torch.Tensor, poison: bool) -> dict[str, torch.Tensor]:
    """Per-token inputs; with ``poison`` the masked positions hold NaN, inf and -inf, else 0."""
    g = torch.Generator().manual_seed(seed)
    out = {name: torch.randn(B, T, generator=g) * 0.3 - (1.0 if "log" in name else 0.0)
           for name in ("log_prob", "old_log_prob", "ref_log_prob", "rollout_log_prob", "advantages", "values",
                        "old_values", "returns", "entropy", "rewards", "weights")}
    fill = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(T)[:T].expand(B, T)
    for name, value in out.items():
        out[name] = torch.where(mask == 0, fill if poison else torch.zeros(()), value)
    return out


def run_losses(poison: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every loss and statistic, and the gradients of log_prob / values / entropy, over one batch."""
    mask = mask_with_gaps()
    t = tensors(0, mask, poison)
    log_prob = t["log_prob"].clone().requires_grad_()
    values = t["values"].clone().requires_grad_()
    entropy = t["entropy"].clone().requires_grad_()
    norm = LossNormalizer(tokens=float(mask.sum()), sequences=float(B), norm_length=float(T))
    results, total = {}, torch.zeros(())
    for kind, agg in itertools.product(POLICY_LOSSES, LOSS_AGG_MODES):
        spec = PolicyLossSpec(kind=kind, agg_mode=agg, clip_ratio_low=0.2, clip_ratio_high=0.3)
        loss, stats = compute_policy_loss(spec, t["old_log_prob"], log_prob, t["advantages"], mask, norm, t["weights"])
        results[f"{kind}/{agg}"] = loss
        results.update({f"{kind}/{agg}/{k}": v for k, v in stats.items()})
        total = total + loss
    for agg in LOSS_AGG_MODES:
        vloss, vstats = value_loss(values, t["old_values"], t["returns"], mask, 0.2, agg, norm)
        results[f"value/{agg}"], results[f"value/{agg}/clipfrac"] = vloss, vstats["vf_clipfrac"]
        results[f"entropy/{agg}"] = agg_loss(entropy, mask, agg, norm)
        for estimator in ("k1", "k2", "k3"):
            results[f"kl/{estimator}/{agg}"] = kl_loss(log_prob, t["ref_log_prob"], mask, estimator, agg, norm)
        total = total + vloss + results[f"entropy/{agg}"] + results[f"kl/k3/{agg}"]
    results["masked_mean"] = masked_mean(entropy, mask)
    results["masked_mean_rows"] = masked_mean(entropy, mask, dim=-1)
    for mode, level in (("tis", "token"), ("tis", "sequence"), ("mis", "token"), ("mis", "sequence")):
        config = RolloutCorrection(mode=mode, level=level, cap=2.0, low=0.5, high=2.0)
        weights, indicators = correction_weights(t["old_log_prob"], t["rollout_log_prob"], mask, config)
        results[f"corr/{mode}/{level}/weights"] = weights
        for key, value in correction_metrics(t["old_log_prob"], t["rollout_log_prob"], mask, norm, weights,
                                             indicators).items():
            results[f"corr/{mode}/{level}/{key}"] = value
    total.backward()
    grads = {"log_prob": log_prob.grad, "values": values.grad, "entropy": entropy.grad}
    return results, grads


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.isfinite(torch.as_tensor(a[key])).all(), key
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0, msg=key)


def test_losses_gradients_and_statistics_ignore_what_masked_positions_hold():
    poisoned, poisoned_grads = run_losses(poison=True)
    zeros, zero_grads = run_losses(poison=False)
    assert_same(poisoned, zeros)
    assert_same(poisoned_grads, zero_grads)
    assert (poisoned_grads["log_prob"][mask_with_gaps() == 0] == 0).all()


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "remax", "reinforce_plus_plus",
                                       "reinforce_plus_plus_baseline"])
def test_advantages_and_the_kl_penalty_ignore_what_masked_positions_hold(estimator):
    mask = mask_with_gaps()
    out = []
    for poison in (True, False):
        t = tensors(1, mask, poison)
        rewards, kl_metrics = apply_kl_penalty(t["rewards"], t["old_log_prob"], t["ref_log_prob"], mask, 0.1, "k3")
        inputs = AdvantageInputs(rewards, mask, values=t["values"], group_index=[0, 0, 1, 1],
                                 baseline_rewards=torch.tensor([0.5, -0.5, 0.0, 1.0]))
        advantages, returns = compute_advantages(estimator, inputs, AdvantageConfig(gamma=0.9, lam=0.95))
        out.append({"rewards": rewards, "advantages": advantages, "returns": returns,
                    "whiten": masked_whiten(t["values"], mask), **{k: torch.tensor(v) for k, v in kl_metrics.items()}})
    assert_same(*out)


def test_step_metrics_ignore_what_masked_positions_hold():
    mask = mask_with_gaps()
    metrics = []
    for poison in (True, False):
        t = tensors(2, mask, poison)
        batch = DataProto({"prompts": torch.ones(B, 3, dtype=torch.long), "responses": torch.ones(B, T, dtype=torch.long),
                           "attention_mask": torch.cat([torch.ones(B, 3, dtype=torch.long), mask], -1),
                           "response_mask": mask, "scores": torch.tensor([1.0, 0.0, 0.5, 0.25]),
                           "token_level_rewards": t["rewards"], "advantages": t["advantages"],
                           "returns": t["returns"], "values": t["values"], "entropys": t["entropy"]})
        metrics.append(batch_metrics(batch))
    assert metrics[0] == metrics[1]
    assert all(v == v for v in metrics[0].values())  # no NaN


@pytest.mark.parametrize("mode", [m for m in LOSS_AGG_MODES if m.startswith("seq-mean")])
def test_a_row_with_no_valid_token_is_not_a_sequence(mode):
    """The mean over sequences skips an empty row, in one batch and summed over micro-batches / DP ranks."""
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).long()
    mask[:, 0] = 1
    mask[2] = 0  # empty
    loss[2] = float("nan")
    keep = [0, 1, 3, 4, 5]
    without = agg_loss(loss[keep], mask[keep], mode)
    torch.testing.assert_close(agg_loss(loss, mask, mode), without)
    # Three micro-batches of two rows (one holds the empty row): each rank's counts summed, as DP sums them.
    counts = [normalizer_counts(mask[i: i + 2]) for i in range(0, 6, 2)]
    tokens, sequences = (sum(c[k] for c in counts) for k in range(2))
    assert (tokens, sequences) == (float(mask.sum()), 5.0)
    norm = LossNormalizer(tokens, sequences, norm_length=5.0)
    parts = sum(agg_loss(loss[i: i + 2], mask[i: i + 2], mode, norm) for i in range(0, 6, 2))
    torch.testing.assert_close(parts, without)
    # The sequence-mean statistic of the rollout correction counts it the same way.
    log_q = torch.randn(6, 5, generator=g)
    whole = correction_metrics(torch.zeros(6, 5), log_q, mask, norm)["ppl_ratio"]
    ratios = (masked_mean(log_q, mask, dim=-1)).exp()[keep]
    torch.testing.assert_close(whole, ratios.sum() / 5)
