"""Per-response-token outputs from the last pipeline stage's model output.

The model ran on rolled rows (see ``packing``); these functions compute the
per-position quantity, roll it back to the original positions and keep the
positions that predict the response tokens.
"""

from __future__ import annotations

import torch

from workers.megatron.engine import MegatronEngine, MicroBatch
from workers.megatron.packing import response_slice, unroll_rows
from workers.megatron.vocab_parallel import vocab_parallel_log_prob_entropy

__all__ = ["response_log_probs", "response_values"]


def response_log_probs(
    engine: MegatronEngine, mb: MicroBatch, logits: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(response token) and the policy entropy at each response position, [B, R] fp32.

    ``logits`` are this TP rank's vocab slice; the sampling temperature divides
    them first, so the log-probs are those of the distribution that sampled.
    """
    next_tokens = torch.roll(mb["input_ids"], shifts=-1, dims=1)
    log_prob, entropy = vocab_parallel_log_prob_entropy(
        logits.float() / temperature, next_tokens, engine.vocab_start(), engine.groups.tp_group
    )
    shift, length = mb["shift"], mb["response_length"]
    return (
        response_slice(unroll_rows(log_prob, shift), length),
        response_slice(unroll_rows(entropy, shift), length),
    )


def response_values(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """The value head's estimate at each response position, [B, R] fp32."""
    return response_slice(unroll_rows(output[..., 0].float(), mb["shift"]), mb["response_length"])
