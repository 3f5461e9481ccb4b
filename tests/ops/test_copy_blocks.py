"""Block copies (the resharding layout transforms) against torch indexing and torch.cat joins.

The QKV reorder and the joins into the generation buffer are also checked end
to end against Hugging Face tensors in test_vllm_layout.py and test_resharder.py.
"""

import pytest
import torch
from torch.library import opcheck

from hybridengine.device import kernel_devices
from hybridengine.model.catalogue import COLUMNS, FC1, REPLICATED, ShardGeometry, ShardKind
from hybridengine.ops import library
from hybridengine.ops.copy_blocks import Block, copy_blocks, copy_blocks_reference
from hybridengine.model.geometry import Piece, join_blocks, join_tp_shards

DEVICES = [d for d in kernel_devices() if library.kernels_on(d)]
# Row-joined geometries of the catalogue's kinds, with shards of one unit (a query group of 1 + 1 + 1 rows).
VOCAB_ROWS = ShardGeometry(ShardKind.VOCAB_ROWS, dim=0, real_units=100)
QKV = ShardGeometry(ShardKind.QKV, dim=0, parts=(1, 1, 1))


def strided_blocks():
    # (source, src_offset, src_stride, dst_offset, dst_stride, rows, cols)
    return [
        Block(0, 3, 10, 0, 7, 4, 7),  # a 4x7 window of a 10-wide source into a 7-wide run
        Block(1, 0, 5, 28, 5, 6, 5),  # contiguous rows
        Block(0, 50, 1, 58, 1, 1, 1),  # a single element
        Block(1, 30, 0, 59, 0, 0, 0),  # an empty block
        Block(1, 1, 5, 60, 2, 3, 2),  # narrow columns
    ]


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_kernel_matches_reference(device, dtype):
    g = torch.Generator().manual_seed(0)
    sources = [(torch.randn(60, generator=g) * 100).to(dtype).to(device),
               (torch.randn(40, generator=g) * 100).to(dtype).to(device)]
    out = torch.zeros(70, dtype=dtype, device=device)
    expected = out.clone()
    table = torch.tensor(strided_blocks())
    copy_blocks(out, sources, table)
    copy_blocks_reference(expected, sources, table)
    assert torch.equal(out, expected)
    assert torch.equal(out[:7], sources[0][3:10])  # first row of the window, by plain indexing
    assert torch.equal(out[60:62], sources[1][1:3])


def shards_for(kind, count):
    g = torch.Generator().manual_seed(1)
    if kind == COLUMNS:
        return [torch.randn(3, 2 + i, generator=g) for i in range(count)]
    rows = 4 if kind == FC1 else 3  # fc1 shards are [gate_i; up_i]
    return [torch.randn(rows, 5, generator=g) for _ in range(count)]


@pytest.mark.parametrize("kind", [VOCAB_ROWS, QKV, COLUMNS, FC1, REPLICATED], ids=lambda g: g.kind)
@pytest.mark.parametrize("count", [1, 2, 3])
def test_join_blocks_equal_torch_cat_joins(kind, count):
    shards = shards_for(kind, count)
    if kind == REPLICATED:
        shards = shards[:1] * count
    expected = join_tp_shards(kind, shards)
    # Shards live back to back in two flat sources; the joined tensor lands at an offset of a buffer.
    sources = [torch.cat([s.reshape(-1) for s in shards[::2]]), torch.cat([s.reshape(-1) for s in shards[1::2]] + [torch.zeros(0)])]
    pieces, cursor = [], [0, 0]
    for i, s in enumerate(shards):
        pieces.append(Piece(i % 2, cursor[i % 2], tuple(s.shape)))
        cursor[i % 2] += s.numel()
    buffer = torch.full((expected.numel() + 9,), float("nan"))
    copy_blocks(buffer, sources, join_blocks(kind, pieces, 9, tuple(expected.shape)))
    assert torch.equal(buffer[9:].view(expected.shape), expected)
    assert buffer[:9].isnan().all()


def test_opcheck():
    sources = [torch.randn(60), torch.randn(40)]
    opcheck(torch.ops.hybridflow.copy_blocks.default, (torch.zeros(70), sources, torch.tensor(strided_blocks())))


def test_bad_blocks_name_the_problem():
    sources = [torch.randn(10)]
    out = torch.zeros(10)
    with pytest.raises(RuntimeError, match="block 0 reads up to element 12 of source 0 which has 10"):
        torch.ops.hybridflow.copy_blocks(out, sources, torch.tensor([[0, 2, 10, 0, 10, 1, 10]]))
    with pytest.raises(RuntimeError, match="block 1 writes up to element 11 of out which has 10"):
        torch.ops.hybridflow.copy_blocks(out, sources, torch.tensor([[0, 0, 1, 0, 1, 1, 1], [0, 0, 1, 10, 1, 1, 1]]))
    with pytest.raises(RuntimeError, match="block 0 addresses overflow int64"):
        torch.ops.hybridflow.copy_blocks(out, sources, torch.tensor([[0, 0, 2**62, 0, 2**62, 5, 1]]))
    with pytest.raises(RuntimeError, match="block 0 names source 1 but there are 1"):
        torch.ops.hybridflow.copy_blocks(out, sources, torch.tensor([[1, 0, 1, 0, 1, 1, 1]]))
    with pytest.raises(RuntimeError, match="source 0 has dtype Double, out has Float"):
        torch.ops.hybridflow.copy_blocks(out, [sources[0].double()], torch.tensor([[0, 0, 1, 0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="source 0 of shape \\(2, 5\\) is not contiguous"):
        copy_blocks(out, [torch.randn(5, 2).t()], [Block(0, 0, 1, 0, 1, 1, 1)])
