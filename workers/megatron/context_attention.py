"""The core attention of packed sequences and context parallelism, for megatron's local layer spec.

megatron-core's local ``DotProductAttention`` takes neither packed sequences
nor context parallelism (only transformer-engine's attention does). This
module takes its place in the layer spec (``core_attention``), so the rest of
megatron's transformer block is unchanged: ``SelfAttention`` projects Q, K and
V, applies RoPE in megatron's THD form (positions restarting at each row,
each CP rank's chunks at theirs; see ``workers.megatron.packed_sequences``)
and hands them here as ``[T, heads, head_dim]`` with a ``SequenceSplit``.

Context parallelism: each rank holds two chunks of every row (megatron's
load-balanced split). K and V are all-gathered over the CP group (backward:
their gradients reduce-scattered back to the rank that holds them), each row's
keys put back in position order, and every local query chunk at positions
[a, a + c) attends causally to the row's keys [0, a + c). No attention crosses
rows. The attention itself is torch's ``scaled_dot_product_attention`` (a
fused kernel on CPU and GPU; softmax accumulated in fp32 for bf16 inputs).
On the CPU grouped K/V are repeated to every query head first: its fused
kernel takes no grouped K/V (torch would fall back to keeping the scores).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from workers.megatron.packed_sequences import SequenceSplit

__all__ = ["ContextParallelAttention", "gather_sequence"]

# torch 2.13 names them *_single; earlier releases *_tensor (the same collectives)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """Forward: every CP rank's tokens, concatenated in rank order along dim 0. Backward: each rank's slice of the
    gradient, summed over the ranks whose queries used it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = tokens.new_empty((size * tokens.shape[0], *tokens.shape[1:]))
        _all_gather(out, tokens.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_sequence(tokens: torch.Tensor, group) -> torch.Tensor:
    """``tokens`` [T, ...] of every rank of ``group`` as [size x T, ...] (differentiable, see ``_GatherSequence``)."""
    return _GatherSequence.apply(tokens, group)


class ContextParallelAttention(MegatronModule):
    """Causal attention over packed rows, split over a context-parallel group (``SequenceSplit``)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout {dropout}: the packed-sequence attention runs without dropout")
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """No parameters, so nothing in a checkpoint (megatron's default would look for global groups)."""
        return {}

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                attn_mask_type=None, attention_bias=None, packed_seq_params: SequenceSplit | None = None):
        """``query`` [T, heads, d], ``key`` / ``value`` [T, groups, d] (this rank's tokens) -> [T, heads x d]."""
        split = packed_seq_params
        if not isinstance(split, SequenceSplit):
            raise ValueError("ContextParallelAttention runs packed micro-batches only: the engine hands every "
                             "forward a SequenceSplit")
        if split.context_parallel > 1:
            key = gather_sequence(key, split.context_group)
            value = gather_sequence(value, split.context_group)
        q = query.permute(1, 0, 2).unsqueeze(0)  # [1, heads, T, d]: the fused kernels take 4-D inputs
        k, v = key.permute(1, 0, 2).unsqueeze(0), value.permute(1, 0, 2).unsqueeze(0)
        gqa = q.shape[1] != k.shape[1]
        if gqa and q.is_cpu:  # the CPU's fused kernel takes no grouped K/V (torch falls back to keeping the scores)
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            gqa = False
        outputs = []  # the pieces cover the local tokens in order
        row_keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, piece in enumerate(split.pieces):
            if piece.row not in row_keys:
                row_keys[piece.row] = self._row_keys(split, piece.row, k, v)
            row_k, row_v = row_keys[piece.row]
            end = piece.first + piece.count
            q_piece = q[:, :, piece.start:piece.start + piece.count]
            if piece.first == 0:  # the keys are exactly the queries' positions: plain causal attention
                attended = F.scaled_dot_product_attention(q_piece, row_k[:, :, :end], row_v[:, :, :end],
                                                          is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
            else:  # queries at [first, end) see keys [0, end): causal, aligned to the last key
                attended = F.scaled_dot_product_attention(q_piece, row_k[:, :, :end], row_v[:, :, :end],
                                                          attn_mask=_offset_causal(split, index, q),
                                                          scale=self.softmax_scale, enable_gqa=gqa)
            outputs.append(attended)
        return torch.cat(outputs, dim=2)[0].permute(1, 0, 2).reshape(query.shape[0], -1)

    @staticmethod
    def _row_keys(split: SequenceSplit, row: int, k: torch.Tensor, v: torch.Tensor):
        """The row's keys and values [1, groups, length, d] in position order."""
        index = split.key_index[row]
        if index is None:  # CP 1: the row's tokens are local and in order
            start = split.row_start[row]
            return k[:, :, start:start + split.row_length[row]], v[:, :, start:start + split.row_length[row]]
        index = index.to(k.device)
        return k.index_select(2, index), v.index_select(2, index)


def _offset_causal(split: SequenceSplit, index: int, query: torch.Tensor):
    """The mask of query piece ``index`` (positions [first, end) against keys [0, end)).

    On an accelerator torch's lower-right causal bias, which its fused kernels apply without materializing
    it. On the CPU, whose kernel materializes any mask and keeps it for backward, an additive mask built once
    per micro-batch and dtype: every layer then keeps the same tensor, not a copy each.
    """
    piece = split.pieces[index]
    end = piece.first + piece.count
    if not query.is_cpu:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(piece.count, end)
    key = (index, query.dtype)
    if key not in split.masks:
        allowed = torch.ones(piece.count, end, dtype=torch.bool).tril(piece.first)
        split.masks[key] = torch.zeros(piece.count, end, dtype=query.dtype).masked_fill(~allowed, float("-inf"))
    return split.masks[key]
