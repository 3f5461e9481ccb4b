"""Safe-RLHF's Lagrange multiplier and advantage combination against values worked out by hand."""

import pytest
import torch

from controller.algorithms import LagrangeMultiplier, combine_advantages


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


def test_lagrange_update_sequence_and_clipping_at_zero():
    lam = LagrangeMultiplier(init=1.0, lr=0.5, cost_limit=1.0)
    assert lam.update(3.0) == pytest.approx(2.0)  # 1 + 0.5 * (3 - 1)
    assert lam.update(torch.tensor(0.0)) == pytest.approx(1.5)  # 2 + 0.5 * (0 - 1)
    assert lam.update(-5.0) == 0.0  # 1.5 - 3 < 0 -> projected to 0
    assert lam.update(1.0) == 0.0  # on the limit: stays
    assert lam.update(1.4) == pytest.approx(0.2)
    assert lam.value == pytest.approx(0.2)


def test_lagrange_max_lambda_and_resume():
    lam = LagrangeMultiplier(init=2.0, lr=1.0, cost_limit=0.0, max_lambda=2.5)
    assert lam.update(10.0) == 2.5
    state = lam.state_dict()
    resumed = LagrangeMultiplier(init=0.0, lr=1.0, max_lambda=2.5)
    resumed.load_state_dict(state)
    assert resumed.value == 2.5
    assert resumed.update(-1.0) == pytest.approx(1.5)
    with pytest.raises(ValueError, match=r"LagrangeMultiplier: value must be <= max_lambda \(2.5\), got 3.0"):
        resumed.load_state_dict({"value": 3.0})
    with pytest.raises(ValueError, match=r"missing key 'value'; got keys \['lambda'\]"):
        resumed.load_state_dict({"lambda": 1.0})


def test_lagrange_bad_arguments():
    with pytest.raises(ValueError, match="LagrangeMultiplier: init must be a finite number >= 0.0, got -1"):
        LagrangeMultiplier(init=-1)
    with pytest.raises(ValueError, match="LagrangeMultiplier: lr must be a finite number > 0.0, got 0"):
        LagrangeMultiplier(lr=0)
    with pytest.raises(ValueError, match="max_lambda must be a finite number >= 0.0, got -2"):
        LagrangeMultiplier(max_lambda=-2)
    with pytest.raises(ValueError, match=r"init must be <= max_lambda \(0.5\), got 1.0"):
        LagrangeMultiplier(init=1.0, max_lambda=0.5)
    with pytest.raises(ValueError, match="mean_episode_cost must be a finite number, got nan"):
        LagrangeMultiplier().update(float("nan"))


def test_combine_advantages():
    a_r, a_c = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]])
    # (1 - 0.5*3) / 1.5 = -1/3; (2 + 0.5) / 1.5 = 5/3
    close(combine_advantages(a_r, a_c, 0.5), [[-1 / 3, 5 / 3]])
    close(combine_advantages(a_r, a_c, torch.tensor(0.5)), [[-1 / 3, 5 / 3]])
    assert torch.equal(combine_advantages(a_r, a_c, 0.0), a_r)
    with pytest.raises(ValueError, match="combine_advantages: lam must be a finite number >= 0.0, got -0.5"):
        combine_advantages(a_r, a_c, -0.5)
    with pytest.raises(ValueError, match=r"cost_advantages shape \(2,\) must equal reward_advantages shape \(1, 2\)"):
        combine_advantages(a_r, torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match=r"lam must be a scalar, got shape \(2,\)"):
        combine_advantages(a_r, a_c, torch.ones(2))
