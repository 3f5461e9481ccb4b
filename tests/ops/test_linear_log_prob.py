"""The fused output layer + log-prob against full logits and torch autograd.

Tolerances: fp32 within 1e-5 of float64 autograd through hidden @ weight.T
and log_softmax. bf16: the fused op rounds each logit tile to bf16 as the
unfused bf16 output layer rounds the whole logits, so the two agree within
one bf16 rounding of a logit (|logit| * 2^-8, here 2e-2); gradients within
bf16 rounding of the fp32-math result.
"""

import pytest
import torch
from torch.library import opcheck

from hybridengine.device import kernel_devices
from hybridengine.ops import library
from hybridengine.ops.linear_log_prob import linear_log_prob_entropy
from hybridengine.ops.log_prob import log_prob_entropy

DEVICES = [d for d in kernel_devices() if library.kernels_on(d)]


def make(rows=13, hidden=24, vocab=200, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden**0.5 * 3
    t = torch.randint(0, vocab, (rows,), generator=g)
    return h.to(device), w.to(device), t.to(device)


def reference(h, w, t, temperature=1.0):
    log_p = torch.log_softmax((h.double() @ w.double().t()) / temperature, dim=-1)
    return log_p.gather(-1, t.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("chunks", [(5, 37), (64, 4096), (1, 1)], ids=["ragged", "one-tile", "tiny"])
def test_fp32_values_and_gradients(device, chunks):
    h, w, t = make(device=device)
    coeff = torch.randn(13, device=device)
    hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = linear_log_prob_entropy(hx, wx, t, temperature=0.7, chunk_rows=chunks[0], chunk_vocab=chunks[1])
    (lp * coeff + 0.3 * ent).sum().backward()
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    ref_lp, ref_ent = reference(hr, wr, t, 0.7)
    (ref_lp * coeff + 0.3 * ref_ent).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(hx.grad.double(), hr.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(wx.grad.double(), wr.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("chunk_rows", [4, 64], ids=["row-tiles", "one-row-tile"])
def test_bf16_agrees_with_the_unfused_bf16_output_layer(device, chunk_rows):
    # one-row-tile: d weight written tile by tile in bf16; row-tiles: summed over row tiles in fp32
    h, w, t = (x.bfloat16() if x.is_floating_point() else x for x in make(seed=3, device=device))
    hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = linear_log_prob_entropy(hx, wx, t, chunk_rows=chunk_rows, chunk_vocab=64)
    (lp + ent).sum().backward()
    hu, wu = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_lp, ref_ent = log_prob_entropy(hu @ wu.t(), t)
    (ref_lp + ref_ent).sum().backward()
    assert hx.grad.dtype == wx.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp, ref_lp, atol=2e-2, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=2e-2, rtol=0)
    torch.testing.assert_close(hx.grad.float(), hu.grad.float(), atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(wx.grad.float(), wu.grad.float(), atol=5e-2, rtol=2e-2)


def test_leading_dims_and_only_one_output_used():
    h, w, t = make()
    hx = h.reshape(13, 1, 24).clone().requires_grad_()
    lp, _ = linear_log_prob_entropy(hx, w, t.reshape(13, 1), chunk_rows=3, chunk_vocab=50)
    assert lp.shape == (13, 1)
    lp.sum().backward()
    hr = h.double().requires_grad_()
    reference(hr, w, t)[0].sum().backward()
    torch.testing.assert_close(hx.grad.reshape(13, 24).double(), hr.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_opcheck(device):
    h, w, t = make(rows=6, hidden=8, vocab=40, device=device)
    ones = torch.ones(6, device=device)
    opcheck(torch.ops.hybridflow.linear_logit_stats.default, (h, w, t, 5, 1.0, 4, 16))
    opcheck(torch.ops.hybridflow.linear_log_prob_entropy.default,
            (h.clone().requires_grad_(), w.clone().requires_grad_(), t, 0.8, 4, 16))
    opcheck(torch.ops.hybridflow.linear_log_prob_entropy_backward.default,
            (ones, ones, h, w, t, ones, ones, 0, 1.0, 4, 16))


def test_bad_inputs_name_the_problem():
    h, w, t = make(rows=4, hidden=8, vocab=30)
    with pytest.raises(RuntimeError, match=r"weight must be \[vocab, 8\]"):
        torch.ops.hybridflow.linear_log_prob_entropy(h, w[:, :5].contiguous(), t, 1.0, 4, 16)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        torch.ops.hybridflow.linear_log_prob_entropy(h, w.double(), t, 1.0, 4, 16)
    with pytest.raises(RuntimeError, match=r"target ids must lie in \[0, 30\)"):
        torch.ops.hybridflow.linear_log_prob_entropy(h, w, t + 30, 1.0, 4, 16)
    with pytest.raises(ValueError, match="chunk_rows and chunk_vocab must be positive"):
        linear_log_prob_entropy(h, w, t, chunk_rows=0)
