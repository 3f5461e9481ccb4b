"""Per-response-token outputs from the last pipeline stage's model output.

The model ran on rolled rows (see ``packing``); these functions compute the
per-position quantity, roll it back to the original positions and keep the
positions that predict the response tokens.
"""

from __future__ import annotations

import torch

from workers.megatron.engine import MegatronEngine, MicroBatch
from workers.megatron.packing import response_slice, unroll_rows
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
    next_tokens = torch.roll(mb["input_ids"], shifts=-1, dims=1)
    tp_group, vocab_start = engine.groups.tp_group, engine.vocab_start()
    if engine.output_deferred:
        log_prob, entropy = linear_log_prob_entropy(
            output, engine.output_weight(), next_tokens, vocab_start, tp_group, temperature,
            vocab_size=engine.spec.vocab_size,
        )
    else:
        log_prob, entropy = vocab_parallel_log_prob_entropy(
            output, next_tokens, vocab_start, tp_group, temperature, vocab_size=engine.spec.vocab_size
        )
    shift, length = mb["shift"], mb["response_length"]
    return (
        response_slice(unroll_rows(log_prob, shift), length),
        response_slice(unroll_rows(entropy, shift), length),
    )


def response_values(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """The value head's estimate at each response position, [B, R] fp32."""
    return response_slice(unroll_rows(output[..., 0].float(), mb["shift"]), mb["response_length"])
