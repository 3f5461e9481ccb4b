"""Per-response-token outputs from the last pipeline stage's model output.

The model ran on rolled, trimmed rows (see ``micro_batches``); these
functions read the output only at the positions that predict the response
tokens (``response_index``), so the output layer, the log-softmax and the
value head never run on prompt positions.

A packed micro-batch (``packed_sequences``) ran as one row of tokens, and
under context parallelism each rank holds part of every row: each rank
computes the response positions it holds (``response_local``) and the
[B, R] results are summed over the CP group, so every CP rank holds all of
them. The sum's backward is the identity: each rank computes the same loss
from the same [B, R] values, and its gradient reaches the positions it
computed; the ranks' weight gradients add up in the data-parallel reduction.
"""

from __future__ import annotations

import torch

from workers.megatron.engine import MegatronEngine
from workers.megatron.micro_batches import MicroBatch
from hybridengine.ops.linear_log_prob import linear_log_prob_entropy
from hybridengine.ops.log_prob import vocab_parallel_log_prob_entropy

__all__ = ["response_log_probs", "response_values"]


def response_log_probs(
    engine: MegatronEngine, mb: MicroBatch, output: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(response token) and the policy entropy at each response position, [B, R] fp32.

    ``output`` is the last stage's model output: hidden states when the engine
    defers its output layer (the fused linear + log-prob op applies this TP
    rank's vocab slice of it), else this rank's vocab slice of the logits.
    The sampling temperature divides the logits first, so the log-probs are
    those of the distribution that sampled. Padded vocabulary ids (from
    ``spec.vocab_size`` on) are left out of the distribution.
    """
    tp_group, vocab_start = engine.groups.tp_group, engine.vocab_start()

    def log_probs(positions: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if engine.output_deferred:
            return linear_log_prob_entropy(
                positions, engine.output_weight(), targets, vocab_start, tp_group, temperature,
                vocab_size=engine.spec.vocab_size,
            )
        return vocab_parallel_log_prob_entropy(
            positions, targets, vocab_start, tp_group, temperature, vocab_size=engine.spec.vocab_size
        )

    if "response_local" in mb:
        own, local = _owned(mb)
        log_prob, entropy = log_probs(output[:, local], mb["responses"][own].unsqueeze(0))
        return _gathered(engine, own, log_prob[0]), _gathered(engine, own, entropy[0])
    # [B, R, H] hidden states or [B, R, V / tp] logits
    return log_probs(_at_response(output, mb["response_index"]), mb["responses"])


def response_values(engine: MegatronEngine, mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """The value head's estimate at each response position, [B, R] fp32."""
    if "response_local" in mb:
        own, local = _owned(mb)
        return _gathered(engine, own, output[0, local, 0].float())
    return _at_response(output, mb["response_index"])[..., 0].float()


def _owned(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed micro-batch's response positions this rank holds: the [B, R] mask, and their local tokens."""
    where = mb["response_local"]
    own = where >= 0
    return own, where[own]


def _gathered(engine: MegatronEngine, own: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[B, R] of this rank's ``values`` at ``own``, summed over the CP group (each position held by one rank)."""
    full = values.new_zeros(own.shape).masked_scatter(own, values)
    if engine.grid.cp == 1:
        return full
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(full, engine.groups.cp_group)


def _at_response(output: torch.Tensor, response_index: torch.Tensor) -> torch.Tensor:
    """``output`` [B, W, D] at the positions ``response_index`` [B, R]: [B, R, D]."""
    index = response_index.to(output.device).unsqueeze(-1).expand(-1, -1, output.shape[-1])
    return output.gather(1, index)
