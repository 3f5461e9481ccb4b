"""Vocabulary rows of the generation shard, regrouped into the rows vLLM holds on each rank.

megatron pads the vocabulary to ``spec.vocab_rows`` (``make_vocab_size_divisible_by``
x TP) and gives TP rank r the rows [r * V_pad / t, (r + 1) * V_pad / t); vLLM
pads it to its own multiple (64) and splits that. Where the two paddings
differ, a vLLM rank's rows of the real vocabulary lie partly in another
rank's megatron shard. Each rank then sends its peers, point to point
within the generation TP group, exactly the real rows they hold in vLLM and
keeps its own: every rank ends with vLLM's per-rank rows, none with more
than its shard plus those rows. Where the paddings agree (the common case)
nothing moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridengine.model.spec import real_vocab_rows

__all__ = ["megatron_vocab_rows", "regroup_vocab_rows"]

Rows = tuple[int, int]  # [start, end) of vocabulary ids


# The real (unpadded) vocabulary rows of megatron TP rank r's shard: (padded_rows, vocab_size, tp, tp_rank).
megatron_vocab_rows = real_vocab_rows


def regroup_vocab_rows(
    tensor: torch.Tensor, held: list[Rows], wanted: list[Rows], my_index: int, group_ranks: list[int], group
) -> torch.Tensor:
    """This rank's ``wanted`` rows, assembled from every rank's ``held`` rows (``tensor`` holds ours).

    ``held[i]`` / ``wanted[i]``: the rows position ``i`` of the group holds /
    needs; ``group_ranks[i]`` its global rank. Collective over ``group``.
    """
    if held == wanted:
        return tensor
    my_start, my_end = held[my_index]
    if tensor.shape[0] != my_end - my_start:
        raise ValueError(f"the shard has {tensor.shape[0]} vocabulary rows, its range {held[my_index]} needs "
                         f"{my_end - my_start}")
    want_start, want_end = wanted[my_index]
    out = tensor.new_empty(want_end - want_start, *tensor.shape[1:])
    requests = []
    for peer, (start, end) in enumerate(wanted):  # what each peer needs from us
        lo, hi = max(start, my_start), min(end, my_end)
        if peer != my_index and lo < hi:
            requests.append(dist.isend(tensor[lo - my_start : hi - my_start].contiguous(), group_ranks[peer], group=group))
    receives = []
    for peer, (start, end) in enumerate(held):  # what we need from each peer
        lo, hi = max(start, want_start), min(end, want_end)
        if lo >= hi:
            continue
        if peer == my_index:
            out[lo - want_start : hi - want_start].copy_(tensor[lo - my_start : hi - my_start])
        else:
            buffer = tensor.new_empty(hi - lo, *tensor.shape[1:])
            requests.append(dist.irecv(buffer, group_ranks[peer], group=group))
            receives.append((lo, hi, buffer))
    for request in requests:
        request.wait()
    for lo, hi, buffer in receives:
        out[lo - want_start : hi - want_start].copy_(buffer)
    return out
