"""GAE and discounted-return kernels against the torch loops (the references) and a hand example."""

import pytest
import torch
from torch.library import opcheck

from hybridengine.device import kernel_devices
from hybridengine.ops import library
from hybridengine.ops.advantage_scan import (
    discounted_returns,
    discounted_returns_reference,
    gae_scan,
    gae_scan_reference,
)

DEVICES = [d for d in kernel_devices() if library.kernels_on(d)]


def make(batch=9, length=17, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=g)
    values = torch.randn(batch, length, generator=g)
    mask = (torch.rand(batch, length, generator=g) > 0.25).float()
    mask[0] = 0.0  # a row with no valid token
    mask[1, :5] = 0.0  # leading padding
    mask[2, -4:] = 0.0  # trailing padding
    mask[3, 6] = 0.5  # a fractional weight passes the later state through in part
    return rewards.to(device), values.to(device), mask.to(device)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_gae_kernel_matches_the_loop(device):
    rewards, values, mask = make(device=device)
    adv, ret = torch.ops.hybridflow.gae(rewards, values, mask, 0.97, 0.9)
    ref_adv, ref_ret = gae_scan_reference(rewards, values, mask, 0.97, 0.9)
    torch.testing.assert_close(adv, ref_adv, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret, ref_ret, atol=1e-6, rtol=1e-6)
    assert (adv[0] == 0).all() and (ret[0] == 0).all()


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_discounted_returns_kernel_matches_the_loop(device):
    rewards, _, mask = make(seed=1, device=device)
    out = torch.ops.hybridflow.discounted_returns(rewards, mask, 0.95)
    torch.testing.assert_close(out, discounted_returns_reference(rewards, mask, 0.95), atol=1e-6, rtol=1e-6)


def test_gae_by_hand():
    # One row, three tokens, the middle one padded: the scan skips it.
    rewards = torch.tensor([[1.0, 5.0, 2.0]])
    values = torch.tensor([[0.5, 9.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    gamma, lam = 0.9, 0.8
    a2 = 2.0 - 1.0  # r2 - V2, nothing after it
    a0 = (1.0 + gamma * 1.0 - 0.5) + gamma * lam * a2  # next valid state is t=2
    adv, ret = gae_scan(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor([[a0, 0.0, a2]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, 0.0, a2 + 1.0]]))
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma), torch.tensor([[1.0, 0.0, 2.0]]))


def test_inputs_of_other_dtypes_and_an_empty_batch():
    rewards, values, mask = make(seed=2)
    adv, _ = gae_scan(rewards.double(), values.half(), mask.bool(), 1.0, 1.0)
    reference = gae_scan_reference(rewards, values.half().float(), mask.bool().float(), 1.0, 1.0)[0]
    torch.testing.assert_close(adv, reference)
    empty = torch.zeros(0, 5)
    assert gae_scan(empty, empty, empty, 1.0, 1.0)[0].shape == (0, 5)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_opcheck(device):
    rewards, values, mask = make(batch=4, length=7, device=device)
    opcheck(torch.ops.hybridflow.gae.default, (rewards, values, mask, 0.9, 0.95))
    opcheck(torch.ops.hybridflow.discounted_returns.default, (rewards, mask, 0.9))


def test_shape_mismatch_is_refused():
    rewards, values, mask = make()
    with pytest.raises(ValueError, match=r"values must be \[batch, length\] like the rewards \(9, 17\)"):
        gae_scan(rewards, values[:, :3], mask, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="mask has shape"):
        torch.ops.hybridflow.gae(rewards, values, mask[:4], 1.0, 1.0)
