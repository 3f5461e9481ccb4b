import itertools

import pytest

from hybridengine.parallel.layout import ParallelLayout


def test_rank_order_is_megatrons_tp_then_dp_then_pp():
    layout = ParallelLayout(tensor_parallel=2, pipeline_parallel=2, data_parallel=2)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [r for r in range(8) if layout.is_collect_rank(r)] == [4, 6]


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 4), (2, 2, 2), (4, 1, 2), (1, 8, 1), (2, 3, 1)])
def test_coordinates_and_groups_partition_the_world(tp, pp, dp):
    layout = ParallelLayout(tp, pp, dp)
    seen = set()
    for rank in range(layout.world_size):
        coord = layout.coordinate(rank)
        assert layout.rank_of(*coord) == rank
        seen.add(coord)
    assert len(seen) == layout.world_size
    for groups in (layout.tp_groups(), layout.pp_groups(), layout.dp_groups(), layout.model_parallel_groups()):
        assert sorted(itertools.chain(*groups)) == list(range(layout.world_size))


def test_for_world_and_refusals():
    assert ParallelLayout.for_world(8, tensor_parallel=2, pipeline_parallel=2) == ParallelLayout(2, 2, 2)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tensor_parallel \* pipeline_parallel = 2 \* 2 = 4"):
        ParallelLayout.for_world(6, 2, 2)
    with pytest.raises(ValueError, match="tensor_parallel size must be a positive integer, got 0"):
        ParallelLayout(0)
    with pytest.raises(ValueError, match="rank 8 outside a layout of 8 ranks"):
        ParallelLayout(2, 2, 2).coordinate(8)


def test_context_parallel_ranks_sit_between_tp_and_dp_as_megatron_orders_them():
    # megatron's order tp-cp-dp-pp: rank = tp + 2 * (cp + 2 * (dp + 2 * pp))
    layout = ParallelLayout.for_world(16, tensor_parallel=2, pipeline_parallel=2, context_parallel=2)
    assert (layout.dp, layout.cp, layout.data_replicas) == (4, 2, 2)
    assert str(layout) == "TP2xCP2xPP2xDP2"
    assert layout.cp_groups()[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_groups()[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [layout.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [layout.data_rank(r) for r in range(16)] == [0, 0, 0, 0, 1, 1, 1, 1] * 2
    # the weights see CP ranks as data-parallel ranks: the same grid, gradients reduced over all four
    assert layout.weights == ParallelLayout(2, 2, 4) and layout.dp_groups() == layout.weights.dp_groups()
    for groups in (layout.cp_groups(), layout.data_groups()):
        assert sorted(itertools.chain(*groups)) == list(range(16))
    assert [r for r in range(16) if layout.is_collect_rank(r)] == [8, 12]  # last stage, TP 0, CP 0


def test_context_parallel_sizes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="context_parallel 3 does not divide the 4 data-parallel ranks"):
        ParallelLayout(1, 1, 4, context_parallel=3)
    with pytest.raises(ValueError, match=r"tensor_parallel \* pipeline_parallel \* context_parallel = 2 \* 1 \* 4"):
        ParallelLayout.for_world(4, tensor_parallel=2, context_parallel=4)
