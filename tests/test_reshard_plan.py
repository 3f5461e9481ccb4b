"""The resharding planner on every legal layout pair up to 8 ranks: no process group."""

import itertools

import pytest

from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.plan import GenerationLayout, ReshardLayoutError, legal_generation_layouts, plan_reshard
from hybridengine.model.catalogue import stage_params


def test_the_papers_example():
    plan = plan_reshard(ParallelLayout(tensor_parallel=4, pipeline_parallel=1, data_parallel=2), GenerationLayout(2, 1))
    assert plan.gen_tp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert plan.micro_dp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.micro_dp_size == 2 and plan.gen_dp == 4
    assert [r.gen_tp_rank for r in plan.ranks] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert plan.ranks[3].source_shards == ((2, 0), (3, 0)) and plan.ranks[3].micro_dp_index == 1


def all_pairs(max_ranks=8):
    for world in range(1, max_ranks + 1):
        for t, p in itertools.product(range(1, world + 1), repeat=2):
            if world % (t * p) == 0:
                train = ParallelLayout(t, p, world // (t * p))
                for gen in legal_generation_layouts(train):
                    yield train, gen


PAIRS = list(all_pairs())


def test_pair_count_covers_both_kinds():
    kinds = {plan_reshard(t, g).kind for t, g in PAIRS}
    assert kinds == {"gather", "slice"} and len(PAIRS) > 60


@pytest.mark.parametrize("train,gen", PAIRS, ids=[f"{t}->{g}" for t, g in PAIRS])
def test_plan_invariants(train, gen):
    plan = plan_reshard(train, gen)
    n, tg, pg = train.world_size, gen.tensor_parallel, gen.pipeline_parallel
    for groups, size in ((plan.gen_tp_groups, tg), (plan.gen_pp_groups, pg), (plan.micro_dp_groups, plan.micro_dp_size)):
        assert sorted(itertools.chain(*groups)) == list(range(n))  # a partition of the ranks
        assert {len(g) for g in groups} == {size}
    for group in plan.gen_tp_groups:
        members = [plan.ranks[r] for r in group]
        assert [m.gen_tp_rank for m in members] == list(range(tg))
        assert len({(m.gen_pp_rank, m.gen_dp_rank) for m in members}) == 1
    for group in plan.gen_pp_groups:
        members = [plan.ranks[r] for r in group]
        assert [m.gen_pp_rank for m in members] == list(range(pg))
        assert len({(m.gen_tp_rank, m.gen_dp_rank) for m in members}) == 1
    # Every generation replica holds each generation shard exactly once.
    replicas = {}
    for r in plan.ranks:
        replicas.setdefault(r.gen_dp_rank, []).append((r.gen_tp_rank, r.gen_pp_rank))
    assert len(replicas) == plan.gen_dp
    for shards in replicas.values():
        assert sorted(shards) == sorted(itertools.product(range(tg), range(pg)))
    for r in plan.ranks:
        own = train.coordinate(r.rank)
        assert r.source_shards[r.micro_dp_index] == (own.tp_rank, own.pp_rank)  # its shard sits in place
        if plan.kind == "gather":
            rt, rp = train.tp // tg, train.pp // pg
            expected = {(a, b) for a in range(r.gen_tp_rank * rt, (r.gen_tp_rank + 1) * rt)
                        for b in range(r.gen_pp_rank * rp, (r.gen_pp_rank + 1) * rp)}
            assert set(r.source_shards) == expected and len(r.source_shards) == rt * rp
            assert len({train.coordinate(m).dp_rank for m in r.micro_dp_group}) == 1  # within one training replica
        else:
            assert own.tp_rank == r.gen_tp_rank // r.slices and r.slice_index == r.gen_tp_rank % r.slices
    shard, d_g = 1000, plan.micro_dp_size
    received = [plan.bytes_received(r, lambda tp, pp: shard) for r in range(n)]
    assert received == [(d_g - 1) * shard] * n  # the lower bound (d_g - 1) * M / (t * p), M = t * p * shard


@pytest.mark.parametrize(
    "train,gen",
    [(ParallelLayout(2, 1, 1), GenerationLayout(3, 1)), (ParallelLayout(2, 2, 1), GenerationLayout(4, 1)),
     (ParallelLayout(1, 2, 1), GenerationLayout(1, 4)), (ParallelLayout(2, 1, 1), GenerationLayout(4, 1))],
)
def test_illegal_pairs_are_refused_with_the_legal_sizes(train, gen):
    with pytest.raises(ReshardLayoutError, match=r"cannot be reached from training .*legal generation sizes: \(tp=1, pp=1\)"):
        plan_reshard(train, gen)


def test_slice_pairs_span_training_replicas():
    plan = plan_reshard(ParallelLayout(2, 1, 2), GenerationLayout(4, 1))
    assert plan.kind == "slice" and plan.gen_tp_groups == ((0, 2, 1, 3),)
    assert [plan.bytes_received(r, lambda tp, pp: 10) for r in range(4)] == [0, 0, 0, 0]


def test_generation_buffer_sources_for_a_pipeline_merge():
    """TP2xPP2 -> TP1xPP1: the one generation stage takes layers 0-1 from stage-0 members and 2-3 from stage-1
    members, TP shards in TP order, a replicated norm from one member only."""
    from hybridengine.model.spec import ModelSpec
    from hybridengine.reshard.weight_plan import expected_bytes_received, generation_sources

    spec = ModelSpec("LlamaForCausalLM", 64, 16, 32, 4, 4, 2, 4, 1e-6, 1e4, 64, False, False)
    plan = plan_reshard(ParallelLayout(2, 2, 1), GenerationLayout(1, 1))
    sources = {s.param.name: s for s in generation_sources(spec, plan, 0)}
    me = plan.ranks[0]
    assert me.micro_dp_group == (0, 1, 2, 3) and me.source_shards == ((0, 0), (1, 0), (0, 1), (1, 1))
    assert sources["decoder.layers.1.mlp.linear_fc1.weight"].members == (0, 1)
    assert sources["decoder.layers.2.mlp.linear_fc1.weight"].members == (2, 3)
    assert sources["decoder.layers.2.mlp.linear_fc1.weight"].train_names == ("decoder.layers.0.mlp.linear_fc1.weight",) * 2
    assert sources["decoder.layers.3.input_layernorm.weight"].members == (2,)
    assert sources["embedding.word_embeddings.weight"].members == (0, 1)
    assert sources["output_layer.weight"].members == (2, 3)
    # Rank 0 receives all but its own pieces: everything except its half of stage 0's sharded tensors.
    total = sum(p.numel for p in stage_params(spec, 1, 1, 0)) * 4
    own = sum(s.param.numel // 2 for s in sources.values() if s.members == (0, 1)) * 4
    own_norms = sum(s.param.numel for s in sources.values() if s.members == (0,)) * 4
    assert expected_bytes_received(spec, plan, 0, 4) == total - own - own_norms
