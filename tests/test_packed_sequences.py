"""Packed rows split over context-parallel ranks (workers.megatron.packed_sequences) and the attention over them
(workers.megatron.context_attention at CP 1), as pure functions: no process group."""

import pytest
import torch

from workers.megatron.context_attention import ContextParallelAttention
from workers.megatron.packed_sequences import padded_length, split_rows


def rows(lengths, width=None):
    width = width or max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1) + 100 * (i + 1)  # row i's token at position p: 100 (i + 1) + p + 1
    return ids, torch.tensor(lengths)


def test_each_cp_rank_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_row():
    ids, valid = rows([7, 3])
    response = torch.tensor([[4, 5, 6], [2, 2, 2]])
    # CP 2: rows padded to 8 and 4 tokens (multiples of 2 x CP), chunks of 2 and 1
    tokens0, where0, split0 = split_rows(ids, valid, response, cp=2, cp_rank=0, pad_rows=False)
    tokens1, where1, split1 = split_rows(ids, valid, response, cp=2, cp_rank=1, pad_rows=False)
    assert split0.row_length == (8, 4)
    assert split0.positions.tolist() == [0, 1, 6, 7, 0, 3]
    assert split1.positions.tolist() == [2, 3, 4, 5, 1, 2]
    assert tokens0[0].tolist() == [101, 102, 107, 0, 201, 0]  # row 0 padded past its 7 tokens, row 1 past 3
    assert tokens1[0].tolist() == [103, 104, 105, 106, 202, 203]
    # megatron's THD layout over the CP ranks: the rows' padded and real boundaries (every rank the same)
    assert split0.cu_seqlens_q_padded.tolist() == split1.cu_seqlens_q_padded.tolist() == [0, 8, 12]
    assert split0.cu_seqlens_q.tolist() == [0, 7, 10] and split0.max_seqlen_q == 8
    # every rank holds as many tokens (a CP-th of each padded row), so the gathered K/V are equal slices
    assert len(tokens0[0]) == len(tokens1[0]) == 12 // 2
    # the gathered tokens of both ranks, put in position order by key_index, are each row again
    gathered = torch.cat([tokens0[0], tokens1[0]])
    assert gathered[split0.key_index[0]].tolist() == [101, 102, 103, 104, 105, 106, 107, 0]
    assert gathered[split0.key_index[1]].tolist() == [201, 202, 203, 0]
    # pieces: rank 1 (the last) holds the two middle chunks of each row, one run of consecutive positions
    assert [(p.row, p.start, p.count, p.first) for p in split1.pieces] == [(0, 0, 4, 2), (1, 4, 2, 1)]
    # each response position is held by exactly one rank, at the local token of that position
    assert ((where0 >= 0) ^ (where1 >= 0)).all()
    for tokens, where, split in ((tokens0, where0, split0), (tokens1, where1, split1)):
        held = where >= 0
        assert split.positions[where[held]].tolist() == response[held].tolist()


def test_row_order_survives_the_gather_exactly():
    ids, valid = rows([9, 5, 12], width=12)
    response = torch.zeros(3, 1, dtype=torch.long)
    for cp in (2, 3):
        parts = [split_rows(ids, valid, response, cp, r, pad_rows=False) for r in range(cp)]
        gathered = torch.cat([tokens[0] for tokens, _, _ in parts])
        for row, n in enumerate([9, 5, 12]):
            index = parts[0][2].key_index[row]
            assert len(index) == padded_length(n, cp)
            assert gathered[index][:n].tolist() == ids[row, :n].tolist()
            assert (gathered[index][n:] == 0).all()


def test_padded_rows_keep_the_micro_batch_width():
    ids, valid = rows([7, 3])
    _, _, packed = split_rows(ids, valid, torch.zeros(2, 1, dtype=torch.long), 1, 0, pad_rows=False)
    _, _, padded = split_rows(ids, valid, torch.zeros(2, 1, dtype=torch.long), 1, 0, pad_rows=True)
    assert packed.row_length == (7, 3) and packed.cu_seqlens_q.tolist() == [0, 7, 10]
    assert packed.cu_seqlens_q_padded.tolist() == [0, 7, 10] and packed.cp_group is None
    assert padded.row_length == (7, 7) and padded.cu_seqlens_q_padded.tolist() == [0, 7, 14]
    assert padded.cu_seqlens_q.tolist() == [0, 7, 10]  # the real tokens: a row's padding is not its own
    assert padded_length(7, 2) == 8 and padded_length(8, 2) == 8 and padded_length(1, 3) == 6


def reference_attention(q, k, v, lengths, scale):
    """Each row alone, causal, written out: softmax(q k^T * scale + causal mask) v, K/V heads repeated."""
    out, start = [], 0
    repeat = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = q[start:start + n], k[start:start + n].repeat_interleave(repeat, 1), \
            v[start:start + n].repeat_interleave(repeat, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        start += n
    return torch.cat(out).reshape(start, -1)


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2)])
def test_packed_attention_equals_each_row_alone(heads, groups):
    from megatron.core.transformer import TransformerConfig

    lengths = [5, 1, 8]
    ids, valid = rows(lengths)
    _, _, split = split_rows(ids, valid, torch.zeros(3, 1, dtype=torch.long), 1, 0, pad_rows=False)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(14, heads, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(14, groups, 16, generator=g, dtype=torch.float64) for _ in range(2))
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, num_query_groups=groups,
                               kv_channels=16, attention_dropout=0.0)
    attention = ContextParallelAttention(config, 1, None, "self")
    got = attention(q, k, v, packed_seq_params=split)
    torch.testing.assert_close(got, reference_attention(q, k, v, lengths, 16 ** -0.5), atol=1e-12, rtol=0)
