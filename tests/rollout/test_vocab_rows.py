"""Vocabulary rows regrouped from megatron's padded split into vLLM's, on real gloo ranks."""

import pytest
import torch
from dist_utils import run_in_processes

from workers.rollout.vocab_rows import megatron_vocab_rows, regroup_vocab_rows

VOCAB, HIDDEN = 301, 6


def full_table():
    return torch.arange(VOCAB * HIDDEN, dtype=torch.float32).view(VOCAB, HIDDEN)


def _worker(rank, world_size, padded_rows, vllm_per_rank):
    import torch.distributed as dist

    held = [megatron_vocab_rows(padded_rows, VOCAB, world_size, r) for r in range(world_size)]
    wanted = [(min(r * vllm_per_rank, VOCAB), min((r + 1) * vllm_per_rank, VOCAB)) for r in range(world_size)]
    start, end = held[rank]
    out = regroup_vocab_rows(full_table()[start:end].clone(), held, wanted, rank, list(range(world_size)),
                             dist.group.WORLD)
    lo, hi = wanted[rank]
    assert torch.equal(out, full_table()[lo:hi]), (rank, held, wanted)


def test_megatron_rows_of_a_padded_vocabulary():
    assert [megatron_vocab_rows(512, VOCAB, 2, r) for r in range(2)] == [(0, 256), (256, 301)]
    # TP4 over 512 rows: the last two ranks hold padding only.
    assert [megatron_vocab_rows(512, VOCAB, 4, r) for r in range(4)] == [(0, 128), (128, 256), (256, 301), (301, 301)]


@pytest.mark.parametrize("world,padded,vllm_per_rank", [
    (2, 512, 160),  # megatron 128 x TP2 = 512 rows (256 a rank), vLLM 64-padded 320 (160 a rank)
    (4, 512, 80),   # megatron 128 rows a rank, the last rank all padding; vLLM 80 a rank
])
def test_each_rank_ends_with_vllms_rows(world, padded, vllm_per_rank):
    run_in_processes(_worker, world, padded, vllm_per_rank)


def test_matching_splits_move_nothing():
    table = full_table()[:160]
    rows = [(0, 160), (160, 301)]
    assert regroup_vocab_rows(table, rows, list(rows), 0, [0, 1], None) is table
