"""The vocab-parallel forms on 2 gloo processes against the single-process result.

Each rank holds its vocab slice of the logits (or of the output-layer
weight); log-probs, entropies and gradients must equal those of the whole
vocabulary in one process (fp32, within 1e-5; the hidden-state gradient of
the linear form is complete on every rank).
"""

import torch

from dist_utils import run_in_processes
from hybridengine.ops.linear_log_prob import linear_log_prob_entropy
from hybridengine.ops.log_prob import log_prob_entropy, vocab_parallel_log_prob_entropy

ROWS, HIDDEN, VOCAB = 11, 16, 96


def inputs():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(ROWS, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    target = torch.randint(0, VOCAB, (ROWS,), generator=g)
    coeff = torch.randn(ROWS, generator=g)
    return hidden, weight, target, coeff


def single_process():
    hidden, weight, target, coeff = inputs()
    logits = (hidden @ weight.t()).requires_grad_()
    lp, ent = log_prob_entropy(logits, target, 0.8)
    (lp * coeff + ent).sum().backward()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lin_lp, lin_ent = linear_log_prob_entropy(h, w, target, temperature=0.8, chunk_rows=4, chunk_vocab=20)
    (lin_lp * coeff + lin_ent).sum().backward()
    return {"lp": lp, "ent": ent, "logits_grad": logits.grad, "lin_lp": lin_lp, "lin_ent": lin_ent,
            "hidden_grad": h.grad, "weight_grad": w.grad}


def _worker(rank, world_size, expected):
    import torch.distributed as dist

    hidden, weight, target, coeff = inputs()
    per_rank = VOCAB // world_size
    start = rank * per_rank
    group = dist.group.WORLD

    logits = (hidden @ weight[start : start + per_rank].t()).requires_grad_()
    lp, ent = vocab_parallel_log_prob_entropy(logits, target, start, group, temperature=0.8)
    (lp * coeff + ent).sum().backward()
    torch.testing.assert_close(lp, expected["lp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, expected["ent"], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits.grad, expected["logits_grad"][:, start : start + per_rank], atol=1e-5, rtol=0)

    h = hidden.clone().requires_grad_()
    w = weight[start : start + per_rank].clone().requires_grad_()
    lin_lp, lin_ent = linear_log_prob_entropy(h, w, target, start, group, 0.8, chunk_rows=4, chunk_vocab=20)
    (lin_lp * coeff + lin_ent).sum().backward()
    torch.testing.assert_close(lin_lp, expected["lin_lp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(lin_ent, expected["lin_ent"], atol=1e-5, rtol=0)
    torch.testing.assert_close(h.grad, expected["hidden_grad"], atol=1e-5, rtol=0)
    torch.testing.assert_close(w.grad, expected["weight_grad"][start : start + per_rank], atol=1e-5, rtol=0)


def test_two_gloo_ranks_match_one_process():
    expected = {k: v.detach() for k, v in single_process().items()}
    run_in_processes(_worker, 2, expected)
