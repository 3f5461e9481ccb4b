"""Padded vocabulary ids take no probability mass: log-probs, entropies, gradients and samples.

The padded rows of the output layer hold large values on purpose (their
logits would dominate if they took part); every result must equal the one
computed over the real vocabulary alone, in one process and on 2 gloo
ranks where the second rank's slice is padding only.
"""

import torch

from dist_utils import run_in_processes
from hybridengine.ops.linear_log_prob import linear_log_prob_entropy
from hybridengine.ops.log_prob import log_prob_entropy, vocab_parallel_log_prob_entropy

ROWS, HIDDEN, VOCAB, PADDED = 9, 16, 50, 128  # 2 ranks of 64 rows: rank 1 holds ids 64..127, all padding


def inputs():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(ROWS, HIDDEN, generator=g)
    weight = torch.randn(PADDED, HIDDEN, generator=g) * 0.5
    weight[VOCAB:] = hidden.mean(0) * 40  # padding rows whose logits would take nearly all the mass
    target = torch.randint(0, VOCAB, (ROWS,), generator=g)
    coeff = torch.randn(ROWS, generator=g)
    return hidden, weight, target, coeff


def real_vocab_reference():
    hidden, weight, target, coeff = inputs()
    h, w = hidden.clone().requires_grad_(), weight[:VOCAB].clone().requires_grad_()
    lp, ent = log_prob_entropy(h @ w.t(), target, 0.9)
    (lp * coeff + ent).sum().backward()
    return {"lp": lp.detach(), "ent": ent.detach(), "hidden_grad": h.grad, "weight_grad": w.grad}


def test_one_process_padded_equals_real_vocab():
    expected = real_vocab_reference()
    hidden, weight, target, coeff = inputs()
    logits = (hidden @ weight.t()).requires_grad_()
    lp, ent = vocab_parallel_log_prob_entropy(logits, target, 0, None, 0.9, vocab_size=VOCAB)
    (lp * coeff + ent).sum().backward()
    torch.testing.assert_close(lp, expected["lp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, expected["ent"], atol=1e-5, rtol=0)
    assert torch.count_nonzero(logits.grad[:, VOCAB:]) == 0
    # Without vocab_size the padding would take the mass: the test's padding is not harmless by accident.
    unmasked, _ = vocab_parallel_log_prob_entropy(hidden @ weight.t(), target, 0, None, 0.9)
    assert (unmasked - expected["lp"]).abs().max() > 1.0

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lin_lp, lin_ent = linear_log_prob_entropy(h, w, target, temperature=0.9, chunk_rows=4, chunk_vocab=16,
                                              vocab_size=VOCAB)
    (lin_lp * coeff + lin_ent).sum().backward()
    torch.testing.assert_close(lin_lp, expected["lp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(lin_ent, expected["ent"], atol=1e-5, rtol=0)
    torch.testing.assert_close(h.grad, expected["hidden_grad"], atol=1e-5, rtol=0)
    torch.testing.assert_close(w.grad[:VOCAB], expected["weight_grad"], atol=1e-5, rtol=0)
    assert torch.count_nonzero(w.grad[VOCAB:]) == 0


def _worker(rank, world_size, expected):
    import torch.distributed as dist

    hidden, weight, target, coeff = inputs()
    per_rank = PADDED // world_size
    start = rank * per_rank
    group = dist.group.WORLD

    logits = (hidden @ weight[start : start + per_rank].t()).requires_grad_()
    lp, ent = vocab_parallel_log_prob_entropy(logits, target, start, group, 0.9, vocab_size=VOCAB)
    (lp * coeff + ent).sum().backward()
    torch.testing.assert_close(lp, expected["lp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, expected["ent"], atol=1e-5, rtol=0)

    h = hidden.clone().requires_grad_()
    w = weight[start : start + per_rank].clone().requires_grad_()
    lin_lp, lin_ent = linear_log_prob_entropy(h, w, target, start, group, 0.9, chunk_rows=4, chunk_vocab=16,
                                              vocab_size=VOCAB)
    (lin_lp * coeff + lin_ent).sum().backward()
    torch.testing.assert_close(lin_lp, expected["lp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(lin_ent, expected["ent"], atol=1e-5, rtol=0)
    torch.testing.assert_close(h.grad, expected["hidden_grad"], atol=1e-5, rtol=0)  # complete on every rank
    real = max(0, min(per_rank, VOCAB - start))
    torch.testing.assert_close(w.grad[:real], expected["weight_grad"][start : start + real], atol=1e-5, rtol=0)
    assert torch.count_nonzero(w.grad[real:]) == 0


def test_two_ranks_one_of_them_all_padding():
    run_in_processes(_worker, 2, real_vocab_reference())


def test_megatron_rollout_sampler_never_draws_a_padded_id():
    from workers.rollout.batch import GenerationRequest
    from workers.rollout.megatron_engine import _RolloutSampling, _Row
    from workers.rollout.sampling import SamplingConfig

    class Sampler(_RolloutSampling):  # the mixin alone: megatron's controller is not needed to sample
        pass

    hidden, weight, _, _ = inputs()
    logits = hidden @ weight.t()
    logits[:, VOCAB:] = logits[:, :VOCAB].max(-1, keepdim=True).values + 20  # the padding would win every draw
    requests = [GenerationRequest(prompt_ids=[1], seed=i) for i in range(ROWS)]
    for sampling in (SamplingConfig(temperature=1.5, seed=0), SamplingConfig(greedy=True)):
        sampler = Sampler()
        sampler.start(requests, sampling, None, None, VOCAB)
        sampler._batch_rows = [_Row(torch.Generator().manual_seed(i)) for i in range(ROWS)]
        drawn = torch.stack([sampler.sample_from_logits(logits, generation_started=torch.ones(ROWS, dtype=torch.bool))
                             for _ in range(200 if not sampling.is_greedy else 1)])
        assert int(drawn.max()) < VOCAB
        expected = torch.log_softmax(logits[:, :VOCAB] / sampling.logprob_temperature, -1)
        for row in range(ROWS):
            tokens = sampler._batch_rows[row].tokens
            assert torch.allclose(torch.tensor(sampler._batch_rows[row].log_probs),
                                  expected[row, tokens], atol=1e-6)
        if sampling.is_greedy:
            assert drawn[0].tolist() == logits[:, :VOCAB].argmax(-1).tolist()
        else:
            assert len(set(drawn[:, 0].tolist())) > 5  # it really samples, over the real vocabulary
