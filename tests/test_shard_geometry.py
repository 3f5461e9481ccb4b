"""Shard geometry as data: a kind of shard the catalogue does not have, described by a ``ShardGeometry`` alone,
round-trips through every layout the hybrid engine uses: cut from Hugging Face tensors and merged back, vLLM's
per-rank layout, the join and split between TP sizes, the block copies into a flat buffer, and the micro-DP
gather schedule. The reference shards are built unit by unit with plain indexing, not by the geometry code."""

import pytest
import torch

from hybridengine.model.catalogue import StageParam
from hybridengine.model.geometry import Piece, ShardGeometry, join_blocks, join_tp_shards, split_tp_shard
from hybridengine.ops.copy_blocks import copy_blocks
from hybridengine.reshard.weight_plan import GenParamSource
from hybridengine.reshard.schedule import gather_schedule
from test_gather_schedule import simulate

UNITS = 8  # padded; the real ones are REAL
REAL = 5
# Rows of two parts per unit (2 + 1), padded, interleaved unit by unit; and columns of two parts stacked per
# shard, padded.
GEOMETRIES = {
    "padded_rows": ShardGeometry("padded_rows", dim=0, parts=(2, 1), interleave="unit", real_units=REAL),
    "padded_columns": ShardGeometry("padded_columns", dim=1, parts=(1, 3), interleave="shard", real_units=REAL),
}


def hf_tensors(geometry):
    """The parts as a Hugging Face checkpoint holds them: real units only."""
    g = torch.Generator().manual_seed(0)
    shapes = [(REAL * size, 3) if geometry.dim == 0 else (3, REAL * size) for size in geometry.parts]
    return [torch.randn(shape, generator=g) for shape in shapes]


def unit_block(geometry, hf, part, unit):
    """Part ``part``'s block of unit ``unit``: its rows (columns), or zeros for a padding unit."""
    size = geometry.parts[part]
    if unit >= REAL:
        shape = list(hf[part].shape)
        shape[geometry.dim] = size
        return torch.zeros(shape)
    return hf[part].narrow(geometry.dim, unit * size, size)


def reference_shard(geometry, hf, tp_rank, tp, vllm=False):
    """TP rank ``tp_rank``'s shard, unit by unit; ``vllm``: part-major and real units only."""
    n = UNITS // tp
    units = range(tp_rank * n, (tp_rank + 1) * n)
    if vllm:
        units = [u for u in units if u < REAL]
    if geometry.interleave == "unit" and not vllm:
        blocks = [unit_block(geometry, hf, p, u) for u in units for p in range(len(hf))]
    else:
        blocks = [unit_block(geometry, hf, p, u) for p in range(len(hf)) for u in units]
    if not blocks:  # a rank of padding only, in vLLM's layout: nothing
        return hf[0].narrow(geometry.dim, 0, 0)
    return torch.cat(blocks, geometry.dim)


def shard_shape(geometry, tp):
    along = UNITS // tp * geometry.unit_size
    return (along, 3) if geometry.dim == 0 else (3, along)


def cut_all(geometry, hf, tp):
    names = [f"part{i}" for i in range(len(hf))]
    by_name = dict(zip(names, hf))
    reads = []

    def read(name, index):
        reads.append((name, index))
        return by_name[name][index]

    shards = [geometry.cut(read, names, r, shard_shape(geometry, tp)) for r in range(tp)]
    return names, shards, reads


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_new_kind_round_trips_hugging_face_and_vllm(name, tp):
    geometry = GEOMETRIES[name]
    hf = hf_tensors(geometry)
    names, shards, reads = cut_all(geometry, hf, tp)
    for r, shard in enumerate(shards):
        assert torch.equal(shard, reference_shard(geometry, hf, r, tp)), (name, tp, r)
        assert torch.equal(geometry.stacked(shard, r), reference_shard(geometry, hf, r, tp, vllm=True)), (name, tp, r)
    # Each rank read only its own rows: every read covers at most its units of one part.
    for part_name, index in reads:
        size = geometry.parts[names.index(part_name)]
        assert index[geometry.dim].stop - index[geometry.dim].start <= UNITS // tp * size
    merged = geometry.merge(shards, names)
    assert list(merged) == names
    for part_name, tensor in zip(names, hf):
        assert torch.equal(merged[part_name], tensor), (name, tp, part_name)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_a_new_kind_joins_splits_and_is_gathered_between_tp_sizes(name):
    geometry = GEOMETRIES[name]
    hf = hf_tensors(geometry)
    _, tp4, _ = cut_all(geometry, hf, 4)
    _, tp2, _ = cut_all(geometry, hf, 2)
    _, tp1, _ = cut_all(geometry, hf, 1)
    for r in range(2):  # TP4 -> TP2 and back
        assert torch.equal(join_tp_shards(geometry, tp4[2 * r: 2 * r + 2]), tp2[r])
        for i in range(2):
            assert torch.equal(split_tp_shard(geometry, tp2[r], 2, i), tp4[2 * r + i])
    assert torch.equal(join_tp_shards(geometry, tp4), tp1[0])

    # Block copies: the four TP4 shards back to back in two flat sources, joined at an offset of a buffer.
    sources = [torch.cat([tp4[0].reshape(-1), tp4[2].reshape(-1)]), torch.cat([tp4[1].reshape(-1), tp4[3].reshape(-1)])]
    numel = tp4[0].numel()
    pieces = [Piece(0, 0, tp4[0].shape), Piece(1, 0, tp4[1].shape), Piece(0, numel, tp4[2].shape),
              Piece(1, numel, tp4[3].shape)]
    buffer = torch.full((tp1[0].numel() + 5,), float("nan"))
    copy_blocks(buffer, sources, join_blocks(geometry, pieces, 5, tp1[0].shape))
    assert torch.equal(buffer[5:].view(tp1[0].shape), tp1[0]) and buffer[:5].isnan().all()

    # The micro-DP gather: a TP2 training layout -> TP1 generation, the two members' shards joined by the
    # schedule into the generation buffer.
    param = StageParam("decoder.layers.0.new_param", tuple(tp1[0].shape), geometry.kind, 0, geometry=geometry)
    source = GenParamSource(param, 0, (0, 1), (param.name,) * 2, (tuple(tp2[0].shape),) * 2)
    for in_place_min in (0, 1 << 40):
        schedule = gather_schedule([source], ((0, 0), (1, 0)), 4, 4 << 10, in_place_min)
        members = [{param.name: tp2[0]}, {param.name: tp2[1]}]
        for me in range(2):
            buffer, received = simulate(schedule, members, me)
            assert torch.equal(buffer.view(tp1[0].shape), tp1[0]), (name, in_place_min, me)
            assert received == tp2[1 - me].numel()  # the other member's shard, once: the bound


def test_bad_geometries_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="interleave 'rows' is not one of"):
        ShardGeometry("x", interleave="rows")
    with pytest.raises(ValueError, match=r"parts \(2, 0\) must be positive"):
        ShardGeometry("x", parts=(2, 0))
    with pytest.raises(ValueError, match="not whole units of 3"):
        ShardGeometry("x", parts=(2, 1)).units((7, 4))
