"""Per-response-token outputs from the last pipeline stage's model output.

The model ran on rolled, trimmed rows (see ``micro_batches``); these
functions read the output only at the positions that predict the response
tokens (``response_index``), so the output layer, the log-softmax and the
value head never run on prompt positions.
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
    positions = _at_response(output, mb["response_index"])  # [B, R, H] hidden states or [B, R, V / tp] logits
    targets = mb["responses"]
    tp_group, vocab_start = engine.groups.tp_group, engine.vocab_start()
    if engine.output_deferred:
        return linear_log_prob_entropy(
            positions, engine.output_weight(), targets, vocab_start, tp_group, temperature,
            vocab_size=engine.spec.vocab_size,
        )
    return vocab_parallel_log_prob_entropy(
        positions, targets, vocab_start, tp_group, temperature, vocab_size=engine.spec.vocab_size
    )


def response_values(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """The value head's estimate at each response position, [B, R] fp32."""
    return _at_response(output, mb["response_index"])[..., 0].float()


def _at_response(output: torch.Tensor, response_index: torch.Tensor) -> torch.Tensor:
    """``output`` [B, W, D] at the positions ``response_index`` [B, R]: [B, R, D]."""
    index = response_index.to(output.device).unsqueeze(-1).expand(-1, -1, output.shape[-1])
    return output.gather(1, index)
