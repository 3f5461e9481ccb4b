"""KL penalty, KL controllers and beta schedules against values worked out by hand."""

import math

import pytest
import torch

from controller.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    ScheduledKLController,
    apply_kl_penalty,
    cosine_schedule,
    exponential_decay,
    linear_schedule,
    make_kl_controller,
)

LN2 = math.log(2)
# Per token: log pi = 0, log ref = ln 0.5, 0, ln 2 -> k1 = ln 2, 0, -ln 2.
LOGP = torch.zeros(2, 3)
REF = torch.tensor([[-LN2, 0.0, LN2], [-LN2, 0.0, LN2]])
SCORES = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
KL_BY_KIND = {
    "k1": [LN2, 0.0, -LN2],
    "k2": [0.5 * LN2**2, 0.0, 0.5 * LN2**2],
    "k3": [(0.5 + LN2 - 1), 0.0, (2 - LN2 - 1)],  # exp(r) - r - 1 with r = log(ref / pi)
}


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_apply_kl_penalty_per_estimator(kind):
    kl = KL_BY_KIND[kind]
    rewards, metrics = apply_kl_penalty(SCORES, LOGP, REF, MASK, beta=0.1, kind=kind)
    expected = [[-0.1 * kl[0], -0.1 * kl[1], 1.0 - 0.1 * kl[2]], [2.0 - 0.1 * kl[0], 0.0, 0.0]]
    close(rewards, expected)
    # Row 0's token mean of its 3 KLs, row 1's single KL, averaged over the 2 rows.
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((sum(kl) / 3 + kl[0]) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1


def test_kl_kind_aliases_and_errors():
    low_var, _ = apply_kl_penalty(SCORES, LOGP, REF, MASK, 0.1, kind="low_var_kl")
    k3, _ = apply_kl_penalty(SCORES, LOGP, REF, MASK, 0.1, kind="k3")
    assert torch.equal(low_var, k3)
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        apply_kl_penalty(SCORES, LOGP, REF, MASK, 0.1, kind="k9")
    with pytest.raises(ValueError, match="apply_kl_penalty: beta must be a finite number >= 0.0, got -0.1"):
        apply_kl_penalty(SCORES, LOGP, REF, MASK, -0.1)
    with pytest.raises(ValueError, match=r"ref_log_probs shape \(2, 2\) must equal token_level_scores shape \(2, 3\)"):
        apply_kl_penalty(SCORES, LOGP, REF[:, :2], MASK, 0.1)


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 256)
    assert ctl.value == 0.05
    with pytest.raises(ValueError, match="FixedKLController: value must be a finite number >= 0.0, got -1"):
        FixedKLController(-1)


def test_adaptive_controller_steps():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctl.update(9.0, 256)  # 9/6 - 1 = 0.5 -> clipped to 0.2; mult = 1 + 0.2 * 256 / 10000
    assert ctl.value == pytest.approx(0.2 * 1.00512)
    ctl.update(3.0, 256)  # -0.5 -> -0.2
    assert ctl.value == pytest.approx(0.2 * 1.00512 * 0.99488)
    ctl.update(6.6, 1000)  # 0.1 unclipped; 1 + 0.1 * 0.1
    assert ctl.value == pytest.approx(0.2 * 1.00512 * 0.99488 * 1.01)
    ctl.update(6.0, 5000)  # on target: unchanged
    assert ctl.value == pytest.approx(0.2 * 1.00512 * 0.99488 * 1.01)

    state = ctl.state_dict()
    fresh = AdaptiveKLController(0.2, 6.0, 10000)
    fresh.load_state_dict(state)
    assert fresh.value == ctl.value
    with pytest.raises(ValueError, match=r"missing key 'value'; got keys \['beta'\]"):
        fresh.load_state_dict({"beta": 1.0})
    with pytest.raises(ValueError, match="target_kl must be a finite number > 0.0, got 0"):
        AdaptiveKLController(0.2, 0, 100)
    with pytest.raises(ValueError, match="horizon must be a finite number > 0.0, got -5"):
        AdaptiveKLController(0.2, 6.0, -5)
    with pytest.raises(ValueError, match="init_kl_coef must be a finite number >= 0.0, got -0.2"):
        AdaptiveKLController(-0.2, 6.0, 10)


def test_linear_schedule():
    s = linear_schedule(1.0, 0.0, 4)
    assert [s(k) for k in (0, 1, 2, 4, 10)] == pytest.approx([1.0, 0.75, 0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="linear_schedule: total_steps must be an int > 0, got 0"):
        linear_schedule(1.0, 0.0, 0)
    with pytest.raises(ValueError, match="linear_schedule: end must be a finite number >= 0.0, got -1"):
        linear_schedule(1.0, -1, 4)
    with pytest.raises(ValueError, match="linear_schedule: step must be an int >= 0, got -1"):
        s(-1)


def test_exponential_decay():
    s = exponential_decay(1.0, 0.5, 2, minimum=0.2)
    assert [s(k) for k in (0, 1, 2, 4, 6)] == pytest.approx([1.0, 1 / math.sqrt(2), 0.5, 0.25, 0.2])
    assert exponential_decay(0.4, 0.1, 1)(3) == pytest.approx(0.4e-3)
    with pytest.raises(ValueError, match=r"decay_rate must be in \(0, 1\], got 1.5"):
        exponential_decay(1.0, 1.5, 2)
    with pytest.raises(ValueError, match="decay_rate must be a finite number > 0.0, got 0"):
        exponential_decay(1.0, 0, 2)
    with pytest.raises(ValueError, match="decay_steps must be a finite number > 0.0, got 0"):
        exponential_decay(1.0, 0.5, 0)
    with pytest.raises(ValueError, match=r"minimum must be <= start \(1.0\), got 2"):
        exponential_decay(1.0, 0.5, 2, minimum=2)


def test_cosine_schedule():
    s = cosine_schedule(1.0, 0.0, 4)
    assert [s(k) for k in (0, 1, 2, 3, 4, 8)] == pytest.approx(
        [1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2, 0.0, 0.0]
    )
    up = cosine_schedule(0.0, 2.0, 2)
    assert [up(k) for k in (0, 1, 2)] == pytest.approx([0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="cosine_schedule: start must be a finite number >= 0.0, got nan"):
        cosine_schedule(float("nan"), 0.0, 4)


def test_scheduled_controller_follows_steps_and_resumes():
    ctl = ScheduledKLController(linear_schedule(1.0, 0.0, 4))
    assert ctl.value == 1.0
    ctl.update(0.3, 1)
    assert ctl.value == pytest.approx(0.75)
    ctl.update(0.3, 2)
    assert ctl.value == pytest.approx(0.25)
    state = ctl.state_dict()
    assert state == {"step": 3}
    resumed = ScheduledKLController(linear_schedule(1.0, 0.0, 4))
    resumed.load_state_dict(state)
    assert resumed.value == pytest.approx(0.25)
    with pytest.raises(ValueError, match="n_steps must be an int >= 0, got -1"):
        ctl.update(0.3, -1)
    with pytest.raises(TypeError, match="schedule must be a callable step -> beta, got 0.1"):
        ScheduledKLController(0.1)


def test_make_kl_controller():
    assert make_kl_controller("fixed", value=0.1).value == 0.1
    adaptive = make_kl_controller("adaptive", init_kl_coef=0.2, target_kl=6.0, horizon=100)
    assert isinstance(adaptive, AdaptiveKLController)
    cos = make_kl_controller("cosine", start=1.0, end=0.0, total_steps=4)
    assert isinstance(cos, ScheduledKLController) and cos.value == 1.0
    exp = make_kl_controller("exponential", start=1.0, decay_rate=0.5, decay_steps=1)
    exp.update(0.0, 2)
    assert exp.value == pytest.approx(0.25)
    assert make_kl_controller("linear", start=0.0, end=1.0, total_steps=2).value == 0.0
    with pytest.raises(ValueError, match=r"unknown KL controller kind 'pid'; valid: \['adaptive', 'cosine', 'exponential', 'fixed', 'linear'\]"):
        make_kl_controller("pid")
    with pytest.raises(ValueError, match=r"kind 'adaptive' takes \['init_kl_coef', 'target_kl', 'horizon'\]; unexpected: \['kl_coef'\], missing: \['init_kl_coef'\]"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10)
    with pytest.raises(ValueError, match="horizon must be a finite number > 0.0, got 0"):
        make_kl_controller("adaptive", init_kl_coef=0.1, target_kl=6.0, horizon=0)
    with pytest.raises(ValueError, match="FixedKLController: value must be a finite number >= 0.0, got -0.1"):
        make_kl_controller("fixed", value=-0.1)
