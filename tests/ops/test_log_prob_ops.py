"""The fused log-prob / entropy ops against torch's log_softmax and their torch references.

Tolerances: fp32 logits, log-probs / entropies / gradients within 1e-5 of a
float64 log_softmax (autograd for the gradients). bf16 logits: the forward
is fp32 math on the bf16 values, so within 1e-5 of float64 on the same
rounded logits; gradients are stored in bf16, so within one bf16 rounding
(relative 2^-8) plus 1e-6.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch.library import opcheck

from hybridengine.device import kernel_devices
from hybridengine.ops import library
from hybridengine.ops.log_prob import (
    log_prob_entropy,
    log_prob_entropy_backward_reference,
    logit_stats_reference,
    merge_logit_stats_reference,
)

DEVICES = [d for d in kernel_devices() if library.kernels_on(d)]
BF16_GRAD_RTOL = 2.0**-8


def make(rows=9, vocab=2500, seed=0, device="cpu", spread=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * spread
    target = torch.randint(0, vocab, (rows,), generator=g)
    return logits.to(device), target.to(device)


def reference(logits, target, temperature=1.0):
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def test_kernels_are_built():
    if os.environ.get(library.DISABLE_ENV) == "1":
        pytest.skip("kernels disabled on purpose")
    assert library.kernels_available(), library.kernels_reason()


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_logit_stats_kernel_matches_reference(device, dtype):
    logits, target = make(device=device)
    logits = logits.to(dtype)
    vocab_start = 700  # targets below 700 or above 3199 fall outside this slice
    stats = torch.ops.hybridflow.logit_stats(logits, target, vocab_start, 0.7)
    ref = logit_stats_reference(logits.double(), target, vocab_start, 0.7)
    assert stats.dtype == torch.float32 and stats.shape == (9, 4)
    torch.testing.assert_close(stats[:, 0].double(), ref[:, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(stats[:, 1:3].double(), ref[:, 1:3], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(stats[:, 3].double(), ref[:, 3], atol=1e-6, rtol=1e-6)
    inside = (target >= vocab_start) & (target < vocab_start + 2500)
    assert inside.any() and (~inside).any()


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fp32_values_and_gradients_match_log_softmax(device, temperature):
    logits, target = make(device=device)
    w_lp, w_ent = torch.randn(9, device=device), torch.randn(9, device=device)
    x = logits.clone().requires_grad_()
    lp, ent = log_prob_entropy(x, target, temperature)
    (lp * w_lp + ent * w_ent).sum().backward()
    y = logits.double().requires_grad_()
    ref_lp, ref_ent = reference(y, target, temperature)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_bf16_logits_compute_in_fp32(device):
    logits, target = make(seed=1, device=device)
    x = logits.bfloat16().requires_grad_()
    lp, ent = log_prob_entropy(x, target)
    assert lp.dtype == ent.dtype == torch.float32
    (lp + ent).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    y = logits.bfloat16().double().requires_grad_()
    ref_lp, ref_ent = reference(y, target)
    (ref_lp + ref_ent).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-6, rtol=BF16_GRAD_RTOL)


def test_large_and_peaked_logits_stay_finite():
    logits, target = make(rows=4, vocab=300, seed=2, spread=2000.0)
    logits[0, target[0]] = 1e4  # one token takes all the mass
    lp, ent = log_prob_entropy(logits, target)
    ref_lp, ref_ent = reference(logits, target)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-3, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    assert abs(lp[0].item()) < 1e-6


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_masked_vocabulary_entries_carry_no_mass(device):
    # -inf logits (a masked vocabulary) count as absent: the result equals the
    # unmasked columns alone, and their gradient is exactly 0.
    logits, target = make(rows=5, vocab=300, seed=4, device=device)
    keep = torch.ones(300, dtype=torch.bool, device=device)
    keep[::3] = False
    keep[target] = True
    masked = logits.masked_fill(~keep, float("-inf")).requires_grad_()
    lp, ent = log_prob_entropy(masked, target)
    (lp + ent).sum().backward()
    kept = logits[:, keep].double().requires_grad_()
    kept_target = torch.cumsum(keep.long(), 0)[target] - 1
    ref_lp, ref_ent = reference(kept, kept_target)
    (ref_lp + ref_ent).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    assert (masked.grad[:, ~keep] == 0).all()
    torch.testing.assert_close(masked.grad[:, keep].double(), kept.grad, atol=1e-5, rtol=0)
    fully_masked = torch.full((1, 10), float("-inf"), device=device)
    stats = torch.ops.hybridflow.logit_stats(fully_masked, target[:1], 0, 1.0)
    assert stats[0, 0] == float("-inf") and stats[0, 1] == 0 and stats[0, 2] == 0


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_backward_kernel_matches_reference(device):
    logits, target = make(device=device)
    log_z = torch.logsumexp(logits * 0.5, dim=-1)
    _, entropy = reference(logits, target, 2.0)
    g_lp, g_ent = torch.randn(9, device=device), torch.randn(9, device=device)
    args = (g_lp, g_ent, logits, target, log_z, entropy.float(), 300, 0.5)
    torch.testing.assert_close(
        torch.ops.hybridflow.log_prob_entropy_backward(*args), log_prob_entropy_backward_reference(*args),
        atol=1e-6, rtol=1e-5,
    )


def test_merging_slices_equals_the_whole_vocabulary():
    logits, target = make()
    bounds = [0, 0, 3, 1000, 1001, 2500]  # an empty slice, a tiny one, a one-column one
    parts = [
        torch.ops.hybridflow.logit_stats(logits[:, a:b].contiguous(), target, a, 1.3)
        for a, b in zip(bounds, bounds[1:])
    ]
    whole = torch.ops.hybridflow.logit_stats(logits, target, 0, 1.3)
    merged = torch.ops.hybridflow.merge_logit_stats(torch.stack(parts))
    torch.testing.assert_close(merged, whole, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(merge_logit_stats_reference(torch.stack(parts)), merged, atol=1e-5, rtol=1e-6)


def _opcheck_cases(device):
    logits, target = make(rows=5, vocab=70, device=device)
    stats = torch.stack([torch.ops.hybridflow.logit_stats(logits[:, :30].contiguous(), target, 0, 1.0),
                         torch.ops.hybridflow.logit_stats(logits[:, 30:].contiguous(), target, 30, 1.0)])
    ones = torch.ones(5, device=device)
    return [
        (torch.ops.hybridflow.logit_stats.default, (logits, target, 10, 0.9)),
        (torch.ops.hybridflow.merge_logit_stats.default, (stats,)),
        (torch.ops.hybridflow.log_prob_entropy.default, (logits.clone().requires_grad_(), target, 0.9)),
        (torch.ops.hybridflow.log_prob_entropy_backward.default, (ones, ones, logits, target, ones, ones, 0, 0.9)),
    ]


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_opcheck(device):
    for op, args in _opcheck_cases(device):
        opcheck(op, args)


def test_compiles_fullgraph_with_gradients():
    logits, target = make(rows=6, vocab=90)

    def loss(x):
        lp, ent = log_prob_entropy(x, target, 0.8)
        return (lp - 0.1 * ent).sum()

    eager_x = logits.clone().requires_grad_()
    loss(eager_x).backward()
    compiled_x = logits.clone().requires_grad_()
    torch.compile(loss, backend="aot_eager", fullgraph=True)(compiled_x).backward()
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)


def test_bad_inputs_name_the_problem():
    logits, target = make(rows=3, vocab=20)
    with pytest.raises(RuntimeError, match=r"target ids must lie in \[0, 20\).*got ids from .* to 25"):
        torch.ops.hybridflow.log_prob_entropy(logits, torch.tensor([0, 25, 3]), 1.0)
    with pytest.raises(RuntimeError, match="logits must be 2-D"):
        torch.ops.hybridflow.logit_stats(logits[None], target, 0, 1.0)
    with pytest.raises(RuntimeError, match=r"dtype Int is not supported \(float32, bfloat16, float16\)"):
        torch.ops.hybridflow.logit_stats(logits.int(), target, 0, 1.0)
    with pytest.raises(RuntimeError, match="target must be 1-D with 3 entries"):
        torch.ops.hybridflow.logit_stats(logits, target[:2], 0, 1.0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        log_prob_entropy(logits, target, 0.0)
    with pytest.raises(ValueError, match="target shape"):
        log_prob_entropy(logits, target[:2])


FALLBACK = """
import warnings
import torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from hybridengine.ops import library
    from hybridengine.ops.log_prob import log_prob_entropy
    from hybridengine.ops.linear_log_prob import linear_log_prob_entropy
notes = [str(w.message) for w in caught if "custom kernels unavailable" in str(w.message)]
assert len(notes) == 1 and "HYBRIDFLOW_DISABLE_OPS=1" in notes[0], notes
assert not library.kernels_available()
g = torch.Generator().manual_seed(0)
x = (torch.randn(7, 50, generator=g) * 3).requires_grad_()
t = torch.randint(0, 50, (7,), generator=g)
lp, ent = log_prob_entropy(x, t)
(lp + ent).sum().backward()
y = x.detach().double().requires_grad_()
ref = torch.log_softmax(y, -1)
(ref.gather(1, t[:, None]).sum() - (ref.exp() * ref).sum()).backward()
torch.testing.assert_close(lp.double(), ref.gather(1, t[:, None])[:, 0].detach(), atol=1e-5, rtol=0)
torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-5, rtol=0)
h, w = torch.randn(7, 8, generator=g), torch.randn(50, 8, generator=g)
lp2, _ = linear_log_prob_entropy(h, w, t)
torch.testing.assert_close(lp2, log_prob_entropy(h @ w.t(), t)[0], atol=1e-5, rtol=0)
try:
    log_prob_entropy(x.detach(), t + 50)
except ValueError as e:
    assert "target ids must lie in [0, 50)" in str(e), e
else:
    raise AssertionError("an out-of-range target was accepted")
print("fallback ok")
"""


def test_without_the_extension_the_references_run_and_say_so_once():
    env = {**os.environ, library.DISABLE_ENV: "1"}
    proc = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fallback ok" in proc.stdout
