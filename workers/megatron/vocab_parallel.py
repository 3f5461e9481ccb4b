"""Log-probs of target tokens and entropy from vocab-sharded logits.

Each tensor-parallel rank holds logits for its slice of the vocabulary
[N, V/tp]. The full [N, V] logits never exist: ranks all-reduce three
per-token numbers (max, sum of exp, target logit) and one more for the
entropy (sum of p * logit), and the backward pass needs no communication,
because every gradient term is local to the rank's slice:

    d log p_t / d z_v = 1[v = t] - p_v
    d H / d z_v      = -p_v (log p_v + H)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_log_prob_entropy"]


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        max_logit = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted = logits - max_logit.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        log_z = sum_exp.log()

        local_target = target - vocab_start
        in_slice = (local_target >= 0) & (local_target < local_vocab)
        index = local_target.clamp(0, local_vocab - 1).unsqueeze(-1)
        target_shifted = torch.where(in_slice, shifted.gather(-1, index).squeeze(-1), torch.zeros_like(log_z))
        target_shifted = _all_reduce(target_shifted, dist.ReduceOp.SUM, group)
        log_prob = target_shifted - log_z

        probs = exp.div_(sum_exp.unsqueeze(-1))  # reuses exp's memory
        mean_shifted = _all_reduce((probs * shifted).sum(dim=-1), dist.ReduceOp.SUM, group)
        entropy = log_z - mean_shifted

        ctx.save_for_backward(probs, shifted, log_z, entropy, index, in_slice)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        probs, shifted, log_z, entropy, index, in_slice = ctx.saved_tensors
        log_probs = shifted - log_z.unsqueeze(-1)
        grad = -probs * (grad_log_prob.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (log_probs + entropy.unsqueeze(-1)))
        grad.scatter_add_(-1, index, (grad_log_prob * in_slice).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_log_prob_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy H(p), per token, in fp32.

    ``logits`` [..., V_local] hold this rank's vocab slice starting at id
    ``vocab_start``; ``group`` is the tensor-parallel group (None: the logits
    cover the whole vocabulary). Differentiable in ``logits``.
    """
    return _VocabParallelLogProbEntropy.apply(logits, target, vocab_start, group)
