"""Output layer + log-prob / entropy without ever holding the logits.

``hidden`` [..., H] times this rank's output-layer weight slice [V_local, H]
gives the logits; the fused op takes them a tile of ``chunk_rows`` x
``chunk_vocab`` at a time, keeps four statistics per token (see
``hybridengine.ops.log_prob``), and in the backward pass recomputes each
tile's logits to fold its gradient into d hidden and d weight. Peak extra
memory is one tile (plus d weight, which the optimizer needs anyway) instead
of the [tokens, V_local] logits, their fp32 copy and the log-softmax.

Under tensor parallelism every rank holds the whole ``hidden`` and its vocab
slice of the weight; the statistics meet in one all-gather, and d hidden is
all-reduced over the group in the backward pass (each rank's slice adds its
share), so the returned gradients are complete.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from hybridengine.ops.library import kernels_available, kernels_on
from hybridengine.ops.log_prob import (
    all_gather_stats,
    check_target_ids,
    empty_logit_stats,
    inverse_temperature,
    real_vocab_columns,
    grad_or_zeros,
    finish_logit_stats,
    log_prob_entropy_backward_reference,
    logit_stats_reference,
    merge_logit_stats_reference,
)

__all__ = ["DEFAULT_CHUNK_ROWS", "DEFAULT_CHUNK_VOCAB", "linear_log_prob_entropy"]

DEFAULT_CHUNK_ROWS = 2048
DEFAULT_CHUNK_VOCAB = 8192


# ----------------------------------------------------------------- references
def _linear_logit_stats_reference(hidden, weight, target, vocab_start, scale, chunk_rows, chunk_vocab):
    return logit_stats_reference(hidden @ weight.t(), target, vocab_start, scale)


def _linear_backward_reference(grad_log_prob, grad_entropy, hidden, weight, target, log_z, entropy, vocab_start,
                               scale, chunk_rows, chunk_vocab):
    grad_logits = log_prob_entropy_backward_reference(
        grad_log_prob, grad_entropy, hidden @ weight.t(), target, log_z, entropy, vocab_start, scale
    ).float()
    return (grad_logits @ weight.float()).to(hidden.dtype), (grad_logits.t() @ hidden.float()).to(weight.dtype)


_REFERENCE = SimpleNamespace(
    linear_logit_stats=_linear_logit_stats_reference,
    merge_logit_stats=merge_logit_stats_reference,
    linear_log_prob_entropy_backward=_linear_backward_reference,
)


def _impl(device: torch.device):
    return torch.ops.hybridflow if kernels_on(device) else _REFERENCE


# ------------------------------------------------------ fake + autograd (kernels)
if kernels_available():

    @torch.library.register_fake("hybridflow::linear_logit_stats")
    def _(hidden, weight, target, vocab_start, scale, chunk_rows, chunk_vocab):
        return hidden.new_empty((hidden.shape[0], 4), dtype=torch.float32)

    @torch.library.register_fake("hybridflow::linear_log_prob_entropy")
    def _(hidden, weight, target, scale, chunk_rows, chunk_vocab):
        rows = hidden.shape[0]
        return hidden.new_empty((rows,), dtype=torch.float32), hidden.new_empty((rows,), dtype=torch.float32)

    @torch.library.register_fake("hybridflow::linear_log_prob_entropy_backward")
    def _(grad_log_prob, grad_entropy, hidden, weight, target, log_z, entropy, vocab_start, scale, chunk_rows,
          chunk_vocab):
        return torch.empty_like(hidden), torch.empty_like(weight)

    def _setup_context(ctx, inputs, output):
        hidden, weight, target, scale, chunk_rows, chunk_vocab = inputs
        log_prob, entropy = output
        ctx.save_for_backward(hidden, weight, target, log_prob, entropy)
        ctx.args = (scale, chunk_rows, chunk_vocab)

    def _backward(ctx, grad_log_prob, grad_entropy):
        hidden, weight, target, log_prob, entropy = ctx.saved_tensors
        scale, chunk_rows, chunk_vocab = ctx.args
        # log Z from the target's own logit h . w_t: x_t - log p_t.
        x_t = (hidden.float() * weight.index_select(0, target).float()).sum(-1) * scale
        grad_hidden, grad_weight = torch.ops.hybridflow.linear_log_prob_entropy_backward(
            grad_or_zeros(grad_log_prob, log_prob), grad_or_zeros(grad_entropy, entropy),
            hidden, weight, target, x_t - log_prob, entropy, 0, scale, chunk_rows, chunk_vocab,
        )
        return grad_hidden, grad_weight, None, None, None, None

    torch.library.register_autograd("hybridflow::linear_log_prob_entropy", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------- public API
class _VocabParallelLinearLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_start, scale, group, chunk_rows, chunk_vocab):
        impl = _impl(hidden.device)
        if weight.shape[0]:
            stats = impl.linear_logit_stats(hidden, weight, target, vocab_start, scale, chunk_rows, chunk_vocab)
        else:  # a rank whose rows are all vocabulary padding
            stats = empty_logit_stats(hidden.shape[0], hidden.device)
        if group is not None and dist.get_world_size(group) > 1:
            stats = impl.merge_logit_stats(all_gather_stats(stats, group))
        log_prob, entropy, log_z = finish_logit_stats(stats)
        ctx.save_for_backward(hidden, weight, target, log_z, entropy)
        ctx.args = (vocab_start, scale, group, chunk_rows, chunk_vocab)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        hidden, weight, target, log_z, entropy = ctx.saved_tensors
        vocab_start, scale, group, chunk_rows, chunk_vocab = ctx.args
        if weight.shape[0]:
            grad_hidden, grad_weight = _impl(hidden.device).linear_log_prob_entropy_backward(
                grad_or_zeros(grad_log_prob, log_z), grad_or_zeros(grad_entropy, entropy),
                hidden, weight, target, log_z, entropy, vocab_start, scale, chunk_rows, chunk_vocab,
            )
        else:
            grad_hidden, grad_weight = torch.zeros_like(hidden), torch.empty_like(weight)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(grad_hidden, group=group)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def linear_log_prob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int = 0,
    group=None,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    chunk_vocab: int = DEFAULT_CHUNK_VOCAB,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and H(p) per token (fp32) of the logits ``hidden @ weight.T`` (divided by ``temperature``).

    ``weight`` [V_local, H] is this rank's vocab slice starting at id
    ``vocab_start``; ``group`` the tensor-parallel group (None: the whole
    vocabulary). Differentiable in ``hidden`` and ``weight``. ``vocab_size``:
    rows of ids from it on are padding and take no part (None: none); their
    gradient is zero.
    """
    scale = inverse_temperature(temperature)
    real = real_vocab_columns(weight.shape[0], vocab_start, vocab_size)
    if real < weight.shape[0]:
        weight = weight[:real]  # a view: autograd gives the padding rows a zero gradient
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must equal hidden shape without the hidden dim "
                         f"{tuple(hidden.shape[:-1])}")
    if chunk_rows <= 0 or chunk_vocab <= 0:
        raise ValueError(f"chunk_rows and chunk_vocab must be positive, got {chunk_rows} and {chunk_vocab}")
    shape = target.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_target = target.reshape(-1).long()
    tensor_parallel = group is not None and dist.get_world_size(group) > 1
    if not tensor_parallel and kernels_on(hidden.device):
        log_prob, entropy = torch.ops.hybridflow.linear_log_prob_entropy(
            flat_hidden, weight, flat_target, scale, chunk_rows, chunk_vocab
        )
    else:
        if not tensor_parallel:  # the kernel op checks this itself
            check_target_ids(flat_target, weight.shape[0])
        log_prob, entropy = _VocabParallelLinearLogProbEntropy.apply(
            flat_hidden, weight, flat_target, vocab_start, scale, group, chunk_rows, chunk_vocab
        )
    return log_prob.reshape(shape), entropy.reshape(shape)
