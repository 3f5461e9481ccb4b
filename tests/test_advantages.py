"""Advantage estimators against values worked out by hand or with plain Python loops."""

import math
import statistics

import numpy as np
import pytest
import torch

from controller.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    get_advantage_estimator,
    masked_var,
    masked_whiten,
    register_advantage_estimator,
)

EPS = 1e-6


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


def whiten_list(xs, eps=EPS):
    mean, var = statistics.mean(xs), statistics.variance(xs)  # variance: n - 1
    return [(x - mean) / math.sqrt(var + eps) for x in xs]


def test_registry_lists_the_builtin_estimators():
    assert {"gae", "grpo", "rloo", "remax", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; registered: \[.*'gae'.*'grpo'.*\]"):
        get_advantage_estimator("ppo")


def test_user_registers_a_custom_estimator():
    @register_advantage_estimator("test_constant_one")
    def constant(inputs, config):
        adv = inputs.response_mask.float() * config.gamma
        return adv, adv

    try:
        inputs = AdvantageInputs(torch.zeros(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]]))
        adv, _ = compute_advantages("test_constant_one", inputs, AdvantageConfig(gamma=0.5))
        assert adv.tolist() == [[0.5, 0.5, 0.0], [0.5, 0.0, 0.0]]
        assert get_advantage_estimator("test_constant_one") is constant
        with pytest.raises(ValueError, match="'test_constant_one' is already registered; pass override=True"):
            register_advantage_estimator("test_constant_one")(constant)
        register_advantage_estimator("test_constant_one", override=True)(constant)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_constant_one", None)
    with pytest.raises(ValueError, match="non-empty string, got ''"):
        register_advantage_estimator("")


def test_gae_by_hand_with_a_padded_row():
    # gamma = lam = 0.5. Row 1 has 2 real tokens; its padding carries garbage that must not leak in.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 4.0], [0.0, 2.0, 9.0, 9.0]])
    values = torch.tensor([[1.0, 2.0, 1.0, 2.0], [1.0, 3.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    inputs = AdvantageInputs(rewards, mask, values=values)
    # Row 0 backwards: d3 = 4 - 2 = 2, A3 = 2; d2 = 0.5*2 - 1 = 0, A2 = 0.25*2 = 0.5;
    # d1 = 0.5*1 - 2 = -1.5, A1 = -1.5 + 0.25*0.5 = -1.375; d0 = 0.5*2 - 1 = 0, A0 = 0.25*-1.375.
    # Row 1: d1 = 2 - 3 = -1, A1 = -1; d0 = 0.5*3 - 1 = 0.5, A0 = 0.5 + 0.25*-1 = 0.25.
    raw = [[-0.34375, -1.375, 0.5, 2.0], [0.25, -1.0, 0.0, 0.0]]
    returns_expected = [[0.65625, 0.625, 1.5, 4.0], [1.25, 2.0, 0.0, 0.0]]
    adv, ret = compute_advantages("gae", inputs, AdvantageConfig(gamma=0.5, lam=0.5, whiten=False))
    close(adv, raw)
    close(ret, returns_expected)

    adv, ret = compute_advantages("gae", inputs, AdvantageConfig(gamma=0.5, lam=0.5, whiten=True))
    w = whiten_list(raw[0] + raw[1][:2])
    close(adv, [w[:4], w[4:] + [0.0, 0.0]])
    close(ret, returns_expected)  # returns come from the raw advantages


def test_gae_with_gamma_and_lam_one_is_monte_carlo_minus_value():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    lengths = [5, 3, 1]
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in lengths])
    adv, _ = compute_advantages("gae", AdvantageInputs(rewards, mask, values=values), AdvantageConfig(whiten=False))
    for b, n in enumerate(lengths):
        for t in range(5):
            expected = float(rewards[b, t:n].sum() - values[b, t]) if t < n else 0.0
            assert adv[b, t].item() == pytest.approx(expected, abs=1e-5)


def grpo_batch(ids):
    # Row sums: 1, 7, 4, 1 (row 2 has a padded garbage reward).
    rewards = torch.tensor([[0.0, 0.0, 1.0], [7.0, 0.0, 0.0], [1.0, 3.0, 5.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    return AdvantageInputs(rewards, mask, group_index=ids), mask


@pytest.mark.parametrize(
    "ids", [np.array(["a", "b", "a", "a"], dtype=object), [10, 20, 10, 10], np.array([3, 1, 3, 3]), torch.tensor([0, 1, 0, 0])]
)
def test_grpo_with_std_non_adjacent_group_of_three_and_a_singleton(ids):
    inputs, mask = grpo_batch(ids)
    # Group {0, 2, 3}: scores 1, 4, 1, mean 2, unbiased std sqrt(6 / 2) = sqrt(3). Row 1 is alone: 0.
    s = math.sqrt(3) + EPS
    per_row = [-1 / s, 0.0, 2 / s, -1 / s]
    adv, ret = compute_advantages("grpo", inputs)
    close(adv, (torch.tensor(per_row)[:, None] * mask).tolist())
    assert torch.equal(adv, ret)


def test_grpo_without_std():
    inputs, _ = grpo_batch(["a", "b", "a", "a"])
    adv, _ = compute_advantages("grpo", inputs, AdvantageConfig(norm_adv_by_std=False))
    assert adv.tolist() == [[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0], [2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


def test_rloo_leave_one_out_baseline():
    rewards = torch.tensor([[1.0, 0.0], [5.0, 0.0], [0.0, 2.0], [3.0, 0.0], [6.0, 4.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    inputs = AdvantageInputs(rewards, mask, group_index=[0, 1, 0, 1, 0])
    # Group 0 scores 1, 2, 6: 1 - 4 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5. Group 1 scores 5, 3: 2, -2.
    adv, ret = compute_advantages("rloo", inputs)
    assert adv.tolist() == [[-3.0, -3.0], [2.0, 0.0], [-1.5, -1.5], [-2.0, -2.0], [4.5, 0.0]]
    assert torch.equal(adv, ret)
    with pytest.raises(ValueError, match="rloo needs at least 2 samples per group; group 'x' has 1"):
        compute_advantages("rloo", AdvantageInputs(rewards[:3], mask[:3], group_index=["x", "y", "y"]))


def test_remax_reward_to_go_minus_greedy_baseline():
    rewards = torch.tensor([[0.0, 1.0, 2.0], [3.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    inputs = AdvantageInputs(rewards, mask, baseline_rewards=torch.tensor([2.5, 1.0]))
    adv, ret = compute_advantages("remax", inputs)
    assert ret.tolist() == [[3.0, 3.0, 2.0], [3.0, 0.0, 0.0]]
    assert adv.tolist() == [[0.5, 0.5, -0.5], [2.0, 0.0, 0.0]]


def test_reinforce_plus_plus_discount_and_whitening():
    rewards = torch.tensor([[0.0, 0.0, 4.0], [1.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantages("reinforce_plus_plus", AdvantageInputs(rewards, mask), AdvantageConfig(gamma=0.5))
    # Row 0: 4, 0.5*4 = 2, 0.5*2 = 1. Row 1 (padding cut): 2, 1 + 0.5*2 = 2.
    assert ret.tolist() == [[1.0, 2.0, 4.0], [2.0, 2.0, 0.0]]
    # mean 2.2, unbiased var 4.8 / 4 = 1.2
    w = whiten_list([1.0, 2.0, 4.0, 2.0, 2.0])
    assert w[0] == pytest.approx(-1.2 / math.sqrt(1.2 + EPS))
    close(adv, [w[:3], w[3:] + [0.0]])


def test_masked_var_and_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_var(x, mask).item() == pytest.approx(statistics.variance([1, 2, 3, 4]))
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(statistics.pvariance([1, 2, 3, 4]))
    w = whiten_list([1, 2, 3, 4], eps=1e-8)
    close(masked_whiten(x, mask), [[w[0], w[1], 0.0], [w[2], 0.0, w[3]]])
    assert masked_var(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]])).item() == 0.0


def test_reinforce_plus_plus_baseline_group_mean_then_batch_whitening():
    # scores 1, 3, 0, 1 (on each row's last real token); groups a = rows 0, 2 and b = rows 1, 3
    rewards = torch.tensor([[0.0, 1.0], [3.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]])
    inputs = AdvantageInputs(rewards, mask, group_index=["a", "b", "a", "b"])
    adv, ret = compute_advantages("reinforce_plus_plus_baseline", inputs)
    # minus the group means (0.5 and 2): 0.5, 1, -0.5, -1 on every real token, then whitened over those 6 tokens
    w = whiten_list([0.5, 0.5, 1.0, -0.5, -0.5, -1.0])
    close(adv, [[w[0], w[1]], [w[2], 0.0], [w[3], w[4]], [w[5], 0.0]], atol=1e-5)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize(
    "name, inputs, message",
    [
        ("gae", {}, r"gae needs values \(a critic\); got None"),
        ("grpo", {}, r"grpo needs group_index \(the prompt id of every sample\); got None"),
        ("rloo", {}, r"rloo needs group_index \(the prompt id of every sample\); got None"),
        ("remax", {}, r"remax needs baseline_rewards \(the greedy rollout's sequence reward\); got None"),
        ("reinforce_plus_plus_baseline", {}, r"reinforce_plus_plus_baseline needs group_index"),
    ],
)
def test_missing_inputs_name_the_input_and_estimator(name, inputs, message):
    with pytest.raises(ValueError, match=message):
        compute_advantages(name, AdvantageInputs(torch.zeros(2, 3), torch.ones(2, 3), **inputs))


def test_bad_shapes_and_config():
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"response_mask shape \(2, 4\) must equal token_level_rewards shape \(2, 3\)"):
        AdvantageInputs(r, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"token_level_rewards must be \[B, T\], got shape \(3,\)"):
        AdvantageInputs(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"values shape \(2, 2\) must equal"):
        AdvantageInputs(r, m, values=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"baseline_rewards must be \[B\] = \(2,\), got shape \(2, 1\)"):
        AdvantageInputs(r, m, baseline_rewards=torch.zeros(2, 1))
    with pytest.raises(ValueError, match="group_index has 3 ids but the batch has 2 rows"):
        AdvantageInputs(r, m, group_index=[0, 0, 1])
    with pytest.raises(ValueError, match=r"group_index entries must be hashable; row 1 has \[1\]"):
        compute_advantages("grpo", AdvantageInputs(r, m, group_index=[0, [1]]))
    with pytest.raises(ValueError, match=r"AdvantageConfig.gamma must be in \[0, 1\], got 1.5"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(ValueError, match=r"AdvantageConfig.lam must be in \[0, 1\], got -0.1"):
        AdvantageConfig(lam=-0.1)
    with pytest.raises(ValueError, match="AdvantageConfig.epsilon must be a finite number > 0, got 0"):
        AdvantageConfig(epsilon=0)


def test_gae_over_a_multi_turn_mask_skips_the_tool_tokens():
    """A multi-turn response interleaves the model's tokens (mask 1) with tool/environment tokens (mask 0).
    GAE runs over the model's tokens as one sequence: its advantages equal those of the compacted row
    (the model tokens alone, concatenated), and the tool tokens get 0."""
    g = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1, 0, 0], [1, 0, 0, 1, 0, 0, 1, 1, 1, 1]])
    rewards, values = torch.randn(2, 10, generator=g), torch.randn(2, 10, generator=g)
    config = AdvantageConfig(gamma=0.9, lam=0.8, whiten=False)
    adv, ret = compute_advantages("gae", AdvantageInputs(rewards * mask, mask, values=values), config)
    for row in range(2):
        keep = mask[row].bool()
        n = int(keep.sum())
        compact = AdvantageInputs(rewards[row, keep][None], torch.ones(1, n, dtype=torch.long),
                                  values=values[row, keep][None])
        c_adv, c_ret = compute_advantages("gae", compact, config)
        close(adv[row, keep][None], c_adv.tolist())
        close(ret[row, keep][None], c_ret.tolist())
        assert (adv[row, ~keep] == 0).all() and (ret[row, ~keep] == 0).all()


def multi_turn_rows():
    """Two multi-turn responses: model turns (mask 1), observation tokens between them (mask 0, holding
    garbage a tool could leave there), right padding; the outcome score on each row's last model token."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 0, 1, 1, 0, 0]])
    rewards = torch.tensor([[0.1, 0.0, 7.0, 7.0, -0.2, 0.0, 7.0, 7.0, 1.0, 7.0],
                            [0.0, 5.0, 5.0, 0.3, 0.0, 5.0, 0.0, -2.0, 5.0, 5.0]])
    return rewards, mask


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "remax"])
def test_returns_carry_the_final_reward_back_across_the_turns(name):
    """REINFORCE++ and ReMax: every model token's return is the sum of the (discounted) rewards after it, as
    on the compacted row (the model tokens alone); an earlier turn sees the final score."""
    rewards, mask = multi_turn_rows()
    gamma = 0.5 if name == "reinforce_plus_plus" else 1.0
    baseline = torch.tensor([0.25, -1.0])
    inputs = AdvantageInputs(rewards, mask, baseline_rewards=baseline)
    adv, ret = compute_advantages(name, inputs, AdvantageConfig(gamma=gamma))
    # By hand. Row 0 compacted [0.1, 0, -0.2, 0, 1]; row 1 compacted [0, 0.3, 0, 0, -2].
    if name == "reinforce_plus_plus":
        hand = [[0.1125, 0.025, 0, 0, 0.05, 0.5, 0, 0, 1.0, 0], [0.025, 0, 0, 0.05, -0.5, 0, -1.0, -2.0, 0, 0]]
    else:
        hand = [[0.9, 0.8, 0, 0, 0.8, 1.0, 0, 0, 1.0, 0], [-1.7, 0, 0, -1.7, -2.0, 0, -2.0, -2.0, 0, 0]]
    close(ret, hand)
    # The compacted rows, computed one row at a time as single-turn responses.
    for row in range(2):
        keep = mask[row].bool()
        n = int(keep.sum())
        one = AdvantageInputs(rewards[row, keep][None], torch.ones(1, n, dtype=torch.long), baseline_rewards=baseline[row:row + 1])
        _, c_ret = compute_advantages(name, one, AdvantageConfig(gamma=gamma))
        close(ret[row, keep][None], c_ret.tolist())
    if name == "remax":
        close(adv, ((ret - baseline[:, None]) * mask).tolist())
    else:
        valid = [r for row, m in zip(ret.tolist(), mask.tolist()) for r, k in zip(row, m) if k]
        w = iter(whiten_list(valid))
        close(adv, [[next(w) if k else 0.0 for k in m] for m in mask.tolist()])
