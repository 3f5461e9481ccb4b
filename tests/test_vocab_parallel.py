"""Vocab-parallel log-prob and entropy against torch.log_softmax on the full vocabulary."""

import torch

from dist_utils import run_in_processes
from workers.megatron.vocab_parallel import vocab_parallel_log_prob_entropy


def reference(logits, target):
    log_p = torch.log_softmax(logits.double(), dim=-1)
    return log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def make(seed=0, n=12, vocab=40):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3, torch.randint(0, vocab, (n,), generator=g)


def test_full_vocab_values_and_gradients():
    logits, target = make()
    w_lp, w_ent = torch.randn(12), torch.randn(12)
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_log_prob_entropy(x, target)
    (lp * w_lp + ent * w_ent).sum().backward()
    y = logits.double().requires_grad_()
    ref_lp, ref_ent = reference(y, target)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-5, rtol=0)


def test_bf16_logits_compute_in_fp32():
    logits, target = make(1)
    lp, ent = vocab_parallel_log_prob_entropy(logits.bfloat16(), target)
    assert lp.dtype == torch.float32
    ref_lp, _ = reference(logits.bfloat16().float(), target)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)


def _tp_worker(rank, world_size):
    import torch.distributed as dist

    logits, target = make(2)
    w_lp, w_ent = torch.randn(12, generator=torch.Generator().manual_seed(5)), torch.ones(12)
    shard = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    lp, ent = vocab_parallel_log_prob_entropy(shard, target, vocab_start=rank * shard.shape[-1], group=dist.group.WORLD)
    (lp * w_lp + ent * w_ent).sum().backward()
    full = logits.double().requires_grad_()
    ref_lp, ref_ent = reference(full, target)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(shard.grad.double(), full.grad.chunk(world_size, dim=-1)[rank], atol=1e-5, rtol=0)


def test_tensor_parallel_over_gloo_matches_the_full_vocabulary():
    run_in_processes(_tp_worker, 2)
    run_in_processes(_tp_worker, 4)
