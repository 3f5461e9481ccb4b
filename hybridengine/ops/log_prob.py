"""Log-probs of target tokens and the entropy, fused, from (vocab-sharded) logits.

Per token, with x = logits / temperature over the whole vocabulary:
    log p_t = x_t - log Z,   H = log Z - sum_v p_v x_v,   log Z = logsumexp(x)
computed without a [tokens, vocab] log-softmax. Each tensor-parallel rank
reduces its vocab slice to four numbers per token (``logit_stats``: max, sum
of exp, sum of exp * shifted logit, target logit), ranks exchange them in one
all-gather and merge (``merge_logit_stats``); the backward pass needs no
communication, every term being local to the slice:
    d log p_t / d x_v = 1[v = t] - p_v,    d H / d x_v = -p_v (log p_v + H)

The compiled kernels run when built (``hybridengine.ops.library``); the torch
references below stand in otherwise, and are what the tests hold them to.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from hybridengine.device.torch_compat import all_gather_single
from hybridengine.ops.library import kernels_available, kernels_on

__all__ = [
    "log_prob_entropy",
    "log_prob_entropy_reference",
    "vocab_parallel_log_prob_entropy",
    "logit_stats_reference",
    "merge_logit_stats_reference",
    "log_prob_entropy_backward_reference",
    "finish_logit_stats",
]


# ----------------------------------------------------------------- references
# The references compute in fp32, or in the input's precision when wider (tests feed them float64).
def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def logit_stats_reference(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, scale: float) -> torch.Tensor:
    """[rows, 4] fp32: (max, sum exp(x - max), sum exp(x - max) (x - max), x_target or 0) of x = scale * logits."""
    x = _wide(logits) * scale
    vocab = x.shape[-1]
    m = x.max(dim=-1).values
    shifted = x - m.unsqueeze(-1)
    e = shifted.exp()
    local = target - vocab_start
    inside = (local >= 0) & (local < vocab)
    x_t = x.gather(-1, local.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    return torch.stack([m, e.sum(-1), (e * shifted).sum(-1), torch.where(inside, x_t, torch.zeros_like(x_t))], -1)


def merge_logit_stats_reference(stats: torch.Tensor) -> torch.Tensor:
    """[slices, rows, 4] -> [rows, 4], as if one slice had held every column."""
    m, s, w, t = _wide(stats).unbind(-1)
    big_m = m.max(dim=0).values
    empty = m == float("-inf")
    offset = torch.where(empty, torch.zeros_like(m), m - big_m)
    a = torch.where(empty, torch.zeros_like(m), offset.exp())
    return torch.stack([big_m, (a * s).sum(0), (a * (w + offset * s)).sum(0), t.sum(0)], -1)


def log_prob_entropy_backward_reference(
    grad_log_prob, grad_entropy, logits, target, log_z, entropy, vocab_start: int, scale: float
) -> torch.Tensor:
    x = _wide(logits) * scale
    vocab = x.shape[-1]
    lp = x - log_z.unsqueeze(-1)
    p = lp.exp()
    grad = -p * (grad_log_prob.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (lp + entropy.unsqueeze(-1)))
    local = target - vocab_start
    inside = (local >= 0) & (local < vocab)
    grad.scatter_add_(-1, local.clamp(0, vocab - 1).unsqueeze(-1), (grad_log_prob * inside).unsqueeze(-1))
    return (grad * scale).to(logits.dtype)


def log_prob_entropy_reference(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0):
    """The plain torch formula (a [tokens, vocab] log-softmax); differentiable through torch autograd."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    log_prob = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_prob, entropy


def finish_logit_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p_t, entropy, log Z) from whole-vocabulary statistics [rows, 4]."""
    m, s, w, t = stats.unbind(-1)
    log_s = s.log()
    log_z = m + log_s
    return t - log_z, log_s - w / s, log_z


_REFERENCE = SimpleNamespace(
    logit_stats=logit_stats_reference,
    merge_logit_stats=merge_logit_stats_reference,
    log_prob_entropy_backward=log_prob_entropy_backward_reference,
)


def _impl(device: torch.device):
    return torch.ops.hybridflow if kernels_on(device) else _REFERENCE


def grad_or_zeros(grad, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad.float().contiguous()


# ------------------------------------------------------ fake + autograd (kernels)
if kernels_available():

    @torch.library.register_fake("hybridflow::logit_stats")
    def _(logits, target, vocab_start, scale):
        return logits.new_empty((logits.shape[0], 4), dtype=torch.float32)

    @torch.library.register_fake("hybridflow::merge_logit_stats")
    def _(stats):
        return stats.new_empty(stats.shape[1:], dtype=torch.float32)

    @torch.library.register_fake("hybridflow::log_prob_entropy")
    def _(logits, target, scale):
        rows = logits.shape[0]
        return logits.new_empty((rows,), dtype=torch.float32), logits.new_empty((rows,), dtype=torch.float32)

    @torch.library.register_fake("hybridflow::log_prob_entropy_backward")
    def _(grad_log_prob, grad_entropy, logits, target, log_z, entropy, vocab_start, scale):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    def _setup_context(ctx, inputs, output):
        logits, target, scale = inputs
        log_prob, entropy = output
        ctx.save_for_backward(logits, target, log_prob, entropy)
        ctx.scale = scale

    def _backward(ctx, grad_log_prob, grad_entropy):
        logits, target, log_prob, entropy = ctx.saved_tensors
        # log Z from the target's own logit: x_t - log p_t.
        log_z = logits.gather(1, target.unsqueeze(1)).squeeze(1).float() * ctx.scale - log_prob
        grad = torch.ops.hybridflow.log_prob_entropy_backward(
            grad_or_zeros(grad_log_prob, log_prob), grad_or_zeros(grad_entropy, entropy),
            logits, target, log_z, entropy, 0, ctx.scale,
        )
        return grad, None, None

    torch.library.register_autograd("hybridflow::log_prob_entropy", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------- public API
def all_gather_stats(stats: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    gathered = stats.new_empty((world * stats.shape[0], *stats.shape[1:]))
    all_gather_single(gathered, stats.contiguous(), group=group)
    return gathered.view(world, *stats.shape)


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, scale, group):
        impl = _impl(logits.device)
        if logits.shape[-1]:
            stats = impl.logit_stats(logits, target, vocab_start, scale)
        else:  # a rank whose slice is all vocabulary padding
            stats = empty_logit_stats(logits.shape[0], logits.device)
        if group is not None and dist.get_world_size(group) > 1:
            stats = impl.merge_logit_stats(all_gather_stats(stats, group))
        log_prob, entropy, log_z = finish_logit_stats(stats)
        ctx.save_for_backward(logits, target, log_z, entropy)
        ctx.vocab_start, ctx.scale = vocab_start, scale
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, target, log_z, entropy = ctx.saved_tensors
        if not logits.shape[-1]:
            return torch.empty_like(logits), None, None, None, None
        grad = _impl(logits.device).log_prob_entropy_backward(
            grad_or_zeros(grad_log_prob, log_z), grad_or_zeros(grad_entropy, entropy),
            logits, target, log_z, entropy, ctx.vocab_start, ctx.scale,
        )
        return grad, None, None, None, None


def _flatten(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must equal logits shape without the vocab dim "
                         f"{tuple(logits.shape[:-1])}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # Rows from the target: a slice with no vocabulary columns (all padding) has no elements to infer them from.
    return logits.reshape(target.numel(), logits.shape[-1]), target.reshape(-1).long()


def empty_logit_stats(rows: int, device) -> torch.Tensor:
    """The statistics of a vocab slice with no columns: what merging treats as absent (max -inf)."""
    stats = torch.zeros(rows, 4, dtype=torch.float32, device=device)
    stats[:, 0] = float("-inf")
    return stats


def real_vocab_columns(local_vocab: int, vocab_start: int, vocab_size: int | None) -> int:
    """How many of a slice's ``local_vocab`` ids starting at ``vocab_start`` are below ``vocab_size``.

    Ids from ``vocab_size`` on are padding (megatron's make_vocab_size_divisible_by):
    cutting them off before the softmax gives them no mass at all.
    """
    if vocab_size is None:
        return local_vocab
    return max(0, min(local_vocab, vocab_size - vocab_start))


def check_target_ids(target: torch.Tensor, vocab: int) -> None:
    """Whole-vocabulary ops: every target id in [0, vocab), as the kernels require."""
    if not target.numel():
        return
    low, high = (int(x) for x in torch.aminmax(target))
    if low < 0 or high >= vocab:
        raise ValueError(f"target ids must lie in [0, {vocab}) (the vocabulary of the logits / weight), "
                         f"got ids from {low} to {high}")


def inverse_temperature(temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return 1.0 / float(temperature)


def log_prob_entropy(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0):
    """log p(target) and the entropy H(p) per token (fp32) from logits [..., vocab] over the whole vocabulary.

    Differentiable in ``logits``; ``temperature`` divides the logits first.
    """
    return vocab_parallel_log_prob_entropy(logits, target, 0, None, temperature)


def vocab_parallel_log_prob_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0, group=None, temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and H(p) per token (fp32) when ``logits`` [..., V_local] hold this rank's vocab slice.

    The slice starts at id ``vocab_start``; ``group`` is the tensor-parallel
    group (None: the logits cover the whole vocabulary). One all-gather of
    [tokens, 4] fp32 per call; differentiable in ``logits``. ``vocab_size``:
    ids from it on are padding, left out of the distribution (None: none).
    """
    scale = inverse_temperature(temperature)
    real = real_vocab_columns(logits.shape[-1], vocab_start, vocab_size)
    if real < logits.shape[-1]:
        logits = logits[..., :real].contiguous()
    shape = target.shape
    flat_logits, flat_target = _flatten(logits, target)
    tensor_parallel = group is not None and dist.get_world_size(group) > 1
    if not tensor_parallel and kernels_on(logits.device):
        log_prob, entropy = torch.ops.hybridflow.log_prob_entropy(flat_logits, flat_target, scale)
    else:
        if not tensor_parallel:  # the kernel op checks this itself
            check_target_ids(flat_target, flat_logits.shape[-1])
        log_prob, entropy = _VocabParallelLogProbEntropy.apply(flat_logits, flat_target, vocab_start, scale, group)
    return log_prob.reshape(shape), entropy.reshape(shape)
