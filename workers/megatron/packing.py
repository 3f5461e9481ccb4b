"""Moving left padding to the right.

RL batches are ``[left-padded prompt | right-padded response]``. megatron's
GPTModel derives rotary positions from the token index (0..S-1) rather than
from ``position_ids``, so each row is rolled left by its padding count: the
valid tokens then start at index 0 and sit at exactly the positions HF gives
them (``cumsum(attention_mask) - 1``), and the causal mask alone keeps every
valid token from seeing padding.
"""

from __future__ import annotations

import torch

__all__ = ["left_pad_counts", "roll_rows", "check_contiguous_rows"]


def left_pad_counts(attention_mask: torch.Tensor) -> torch.Tensor:
    """Number of leading padding positions in each row."""
    return attention_mask.long().cumsum(-1).eq(0).sum(-1)


def check_contiguous_rows(attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
    """Each row must be one block of valid tokens, with positions 0..n-1 over it."""
    mask = attention_mask.long()
    starts = (mask[:, 1:] - mask[:, :-1]).clamp(min=0).sum(-1) + mask[:, 0]
    bad = (starts > 1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"rows {bad[:5]} have gaps in attention_mask; each row must be one block of valid tokens")
    if position_ids is not None:
        expected = (mask.cumsum(-1) - 1).clamp(min=0)
        wrong = ((position_ids != expected) & mask.bool()).any(-1).nonzero().flatten().tolist()
        if wrong:
            raise ValueError(
                f"rows {wrong[:5]} have position_ids other than 0..n-1 over their valid tokens; "
                "only such positions are supported"
            )


def _rolled_index(shift: torch.Tensor, length: int) -> torch.Tensor:
    return (torch.arange(length, device=shift.device).unsqueeze(0) + shift.unsqueeze(-1)) % length


def roll_rows(tokens: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Row i rolled left by shift[i]: out[i, t] = tokens[i, (t + shift[i]) % S] (any dimensions after t ride along)."""
    index = _rolled_index(shift, tokens.shape[1])
    index = index.reshape(*index.shape, *(1,) * (tokens.dim() - 2)).expand_as(tokens)
    return tokens.gather(1, index)
