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
    # The return carries across the gap too (issue #30: it used to restart there, giving 1.0 at t=0).
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma), torch.tensor([[1.0 + gamma * 2.0, 0.0, 2.0]]))


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


def turns(seed: int, batch: int = 6, length: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn rows: model turns (mask 1) with observation gaps (mask 0) between them, right padding after,
    rewards everywhere (the gaps' rewards must not be read)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length)
    for row in range(batch):
        t = 0
        while t < length - 4:
            turn = int(torch.randint(1, 5, (), generator=g))
            mask[row, t: t + turn] = 1.0
            t += turn + int(torch.randint(1, 5, (), generator=g))
    return torch.randn(batch, length, generator=g), mask


def compacted(fn, *tensors, mask):
    """``fn`` run on each row's valid positions alone, scattered back (0 elsewhere)."""
    outs = None
    for row in range(mask.shape[0]):
        keep = mask[row] != 0
        res = fn(*(t[row, keep][None] for t in tensors), torch.ones(1, int(keep.sum())))
        res = res if isinstance(res, tuple) else (res,)
        if outs is None:
            outs = [torch.zeros_like(mask) for _ in res]
        for out, r in zip(outs, res):
            out[row, keep] = r[0]
    return outs


@pytest.mark.parametrize("device", ["reference", *DEVICES], ids=str)
def test_scans_carry_across_observation_gaps_as_on_the_compacted_row(device):
    rewards, mask = turns(seed=5)
    values = torch.randn_like(rewards)
    if device == "reference":
        scan_returns = discounted_returns_reference
        scan_gae = gae_scan_reference
    else:
        def scan_returns(r, m, gamma):
            return torch.ops.hybridflow.discounted_returns(r.to(device), m.to(device), gamma).cpu()

        def scan_gae(r, v, m, gamma, lam):
            return tuple(x.cpu() for x in torch.ops.hybridflow.gae(r.to(device), v.to(device), m.to(device), gamma, lam))

    (expected,) = compacted(lambda r, m: discounted_returns_reference(r, m, 0.9), rewards, mask=mask)
    torch.testing.assert_close(scan_returns(rewards, mask, 0.9), expected, atol=1e-6, rtol=1e-6)
    exp_adv, exp_ret = compacted(lambda r, v, m: gae_scan_reference(r, v, m, 0.9, 0.8), rewards, values, mask=mask)
    adv, ret = scan_gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, exp_adv, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret, exp_ret, atol=1e-6, rtol=1e-6)
    # Whatever the gaps and the padding hold, NaN and inf included, is never read.
    poisoned = torch.where(mask == 0, torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(8)[: mask.shape[1]],
                           rewards)
    torch.testing.assert_close(scan_returns(poisoned, mask, 0.9), expected, atol=1e-6, rtol=1e-6)
    adv_p, ret_p = scan_gae(poisoned, torch.where(mask == 0, float("nan"), values), mask, 0.9, 0.8)
    torch.testing.assert_close(adv_p, exp_adv, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret_p, exp_ret, atol=1e-6, rtol=1e-6)


def test_returns_across_turns_by_hand():
    # Three turns and right padding; the outcome score sits on the last model token (t = 8).
    rewards = torch.tensor([[0.1, 0.0, 7.0, 7.0, -0.2, 0.0, 7.0, 7.0, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    # compacted row [0.1, 0, -0.2, 0, 1] with gamma 0.5: 1, 0.5, 0.05, 0.025, 0.1125
    expected = torch.tensor([[0.1125, 0.025, 0.0, 0.0, 0.05, 0.5, 0.0, 0.0, 1.0, 0.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), expected)
    torch.testing.assert_close(discounted_returns_reference(rewards, mask, 0.5), expected)
