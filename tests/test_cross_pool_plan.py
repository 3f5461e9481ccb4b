"""The cross-pool planner, for every legal (training layout, generation layout, pool sizes) up to 8 + 8 ranks.

A model of M bytes: a training shard is M / (t p), a slice of one M / (t p k). Checked for each pair:
every generation rank receives each segment of its shard exactly once and nothing else, so exactly
M / (t_g p_g), the bound; each segment comes from a training rank that holds it; the segments are the
ones that join (or slice into) that shard; training ranks receive nothing; relays stay inside the
replica group; the totals are d_g * M (p2p) or M out of training plus (d_g - 1) * M relayed
(broadcast); and the chosen method's busiest link is the smaller of the two.
"""

import itertools

import pytest

from hybridengine.cross_pool.plan import cross_pool_generation_layouts, plan_cross_pool
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.plan import GenerationLayout, ReshardLayoutError

M = 40320  # 8!: every shard and slice size below is a whole number of bytes


def training_layouts(max_ranks=8):
    for t, p, d in itertools.product(range(1, 9), repeat=3):
        if t * p * d <= max_ranks:
            yield ParallelLayout(t, p, d)


def legal_pairs(max_ranks=8):
    for train in training_layouts(max_ranks):
        for gen in cross_pool_generation_layouts(train):
            for dg in range(1, max_ranks // (gen.tensor_parallel * gen.pipeline_parallel) + 1):
                yield train, gen, dg


PAIRS = list(legal_pairs())


def test_the_pairs_cover_joins_slices_and_many_replicas():
    assert len(PAIRS) > 300
    assert any(g.tensor_parallel > t.tp for t, g, _ in PAIRS)  # slices
    assert any(g.pipeline_parallel < t.pp for t, g, _ in PAIRS)  # joined stages
    assert any(dg > t.dp for t, _, dg in PAIRS) and any(dg < t.dp for t, _, dg in PAIRS)


def segment_size(plan):
    def size(gtp, gpp, i):
        seg = plan.shard_segments(gtp, gpp)[i]
        return M // (plan.train.tp * plan.train.pp * seg.slices)
    return size


def test_every_legal_pair_meets_the_bound_with_the_right_segments():
    methods = set()
    for train, gen, dg in PAIRS:
        plan = plan_cross_pool(train, gen, dg)
        methods.add(plan.method)
        tg, pg = gen.tensor_parallel, gen.pipeline_parallel
        rt, rp = max(train.tp // tg, 1), train.pp // pg
        k = max(tg // train.tp, 1)
        for gpp, gtp in itertools.product(range(pg), range(tg)):
            segments = plan.shard_segments(gtp, gpp)
            if k == 1:  # the r_t x r_p training shards the generation shard joins, each whole
                assert sorted((s.train_tp, s.train_pp) for s in segments) == sorted(
                    (gtp * rt + a, gpp * rp + b) for a in range(rt) for b in range(rp))
                assert all(s.slices == 1 for s in segments)
            else:  # one slice of one training shard
                assert [(s.train_tp, s.train_pp, s.slice_index, s.slices) for s in segments] == [(gtp // k, 0, gtp % k, k)]
        size = segment_size(plan)
        for rank in range(plan.gen_world_size):
            coord = plan.gen_coordinate(rank)
            got = sorted(r.position for r in plan.routes_into(rank))
            assert got == list(range(len(plan.shard_segments(coord.tp_rank, coord.pp_rank)))), (train, gen, dg, rank)
            assert all((r.gen_tp, r.gen_pp) == (coord.tp_rank, coord.pp_rank) for r in plan.routes_into(rank))
        for route in plan.routes:
            seg = plan.shard_segments(route.gen_tp, route.gen_pp)[route.position]
            holder = train.coordinate(route.src)
            assert (holder.tp_rank, holder.pp_rank) == (seg.train_tp, seg.train_pp)
            assert len(set(route.chain)) == len(route.chain)
        links = plan.link_bytes(size)
        assert set(links.gen_received) == {M // (tg * pg)} == {plan.lower_bound(M)}, (train, gen, dg)
        assert set(links.train_received) == {0}
        if plan.method == "p2p":
            assert sum(links.train_sent) == dg * M and set(links.gen_sent) == {0}
            assert all(len(r.chain) == 1 for r in plan.routes)
        else:
            assert sum(links.train_sent) == M and sum(links.gen_sent) == (dg - 1) * M
            assert all(len(r.chain) == dg for r in plan.routes)
        other = plan_cross_pool(train, gen, dg, "broadcast" if plan.method == "p2p" else "p2p")
        assert links.busiest <= other.link_bytes(segment_size(other)).busiest
    assert methods == {"p2p", "broadcast"}


def test_p2p_spreads_the_sending_over_the_training_replicas():
    for train, gen, dg in PAIRS:
        plan = plan_cross_pool(train, gen, dg, "p2p")
        sent = plan.link_bytes(segment_size(plan)).train_sent
        k = max(gen.tensor_parallel // train.tp, 1)
        # Each training coordinate's demand is d_g * k slices; its d holders share it to within one slice.
        for tp, pp in itertools.product(range(train.tp), range(train.pp)):
            holders = [sent[train.rank_of(tp, pp, r)] for r in range(train.dp)]
            unit = M // (train.tp * train.pp * k)
            assert max(holders) - min(holders) <= unit, (train, gen, dg, holders)


def test_the_choice_and_its_reason():
    # Two training ranks (TP2) feeding six TP2 replicas: p2p sends each training shard six times,
    # broadcast once (and relays it down the replica chain).
    plan = plan_cross_pool(ParallelLayout(2, 1, 1), GenerationLayout(2, 1), 6)
    assert plan.method == "broadcast"
    assert plan.reason == "busiest link: p2p 6, broadcast 1 (units of segment_bytes); broadcast chosen"
    # As many training replicas as generation ones: straight sends, nothing relayed.
    plan = plan_cross_pool(ParallelLayout(2, 1, 2), GenerationLayout(1, 1), 2)
    assert plan.method == "p2p"
    assert plan.link_bytes(lambda *a: 1).busiest == 2  # the generation rank's own shard: 2 segments
    # A forced method is kept.
    assert plan_cross_pool(ParallelLayout(2, 1, 1), GenerationLayout(2, 1), 6, "p2p").method == "p2p"


def test_illegal_pairs_are_refused_naming_what_is_legal():
    with pytest.raises(ReshardLayoutError, match=r"generation tensor_parallel=3, pipeline_parallel=1 cannot be fed "
                                                 r"from training TP2xPP1xDP1.*legal generation sizes: \(tp=1, pp=1\)"):
        plan_cross_pool(ParallelLayout(2, 1, 1), GenerationLayout(3, 1), 1)
    with pytest.raises(ReshardLayoutError, match="pipeline_parallel=2 cannot be fed from training TP1xPP1xDP2"):
        plan_cross_pool(ParallelLayout(1, 1, 2), GenerationLayout(1, 2), 1)
    with pytest.raises(ReshardLayoutError, match="at least one replica, got gen_dp=0"):
        plan_cross_pool(ParallelLayout(1, 1, 1), GenerationLayout(1, 1), 0)
    with pytest.raises(ValueError, match=r"cross-pool method 'nccl' is not one of \('auto', 'p2p', 'broadcast'\)"):
        plan_cross_pool(ParallelLayout(1, 1, 1), GenerationLayout(1, 1), 1, "nccl")


def test_the_experts_cross_pools_at_their_bound_from_every_holder():
    """A mixture of experts' experts across pools: every generation rank receives all of its generation experts
    (it holds nothing), each piece from a training rank that holds it, the expert-DP holders sharing the load;
    and the rollout pool learns the actor's expert grid from the same arguments the trainer gives it."""
    from hybridengine.reshard.expert_group import plan_cross_pool_experts
    from hybridengine.model.spec import ModelSpec
    from hybridengine.reshard.expert_group import held_units
    from controller.rl.rollout_pool import separate_rollout_kwargs
    from workers.megatron.config import EngineConfig
    from test_moe_layout import QWEN3_MOE

    spec = ModelSpec.from_hf_config(QWEN3_MOE)  # 8 experts, expert FFN 32
    for train, gen, gen_dp in [(ParallelLayout(1, 1, 4, 2, 1), GenerationLayout(1, 1), 2),
                               (ParallelLayout(2, 1, 2, 2, 1), GenerationLayout(2, 1), 3),
                               (ParallelLayout(2, 2, 2, 2, 2), GenerationLayout(4, 1, True), 1)]:
        if gen.tensor_parallel > train.tp and train.pp > 1:
            continue
        experts = plan_cross_pool_experts(spec, plan_cross_pool(train, gen, gen_dp))
        load = [0] * train.world_size
        for g, needs in enumerate(experts.needs):
            share = 8 // gen.tensor_parallel if gen.expert_parallel else 8
            width = 32 if gen.expert_parallel else 32 // gen.tensor_parallel
            layers = spec.num_layers // gen.pipeline_parallel
            assert sum(n.units[1] - n.units[0] for n in needs) == layers * share * width  # everything, nothing more
            assert experts.bound(g, 2) == layers * share * width * 3 * spec.hidden_size * 2
            for need in needs:
                cursor = need.units[0]
                for piece in need.pieces:  # tiled in order, each from a holder
                    assert piece.units[0] == cursor
                    cursor = piece.units[1]
                    held = held_units(spec, train, piece.source, piece.layer, piece.expert)
                    assert held is not None and held[0] <= piece.units[0] and piece.units[1] <= held[1]
                    load[piece.source] += piece.size
                assert cursor == need.units[1]
        holders = {}  # the expert-DP replicas of one expert shard send alike
        for rank in range(train.world_size):
            at = train.expert_coordinate(rank)
            holders.setdefault((at.pp_rank, at.ep_rank, at.etp_rank), []).append(load[rank])
        assert all(max(sent) - min(sent) <= 32 for sent in holders.values()), holders
    kwargs = separate_rollout_kwargs({"model_path": "m"}, EngineConfig(tensor_parallel=2, expert_parallel=2,
                                                                       expert_tensor_parallel=1), 8)
    training = kwargs["training"]
    assert (training.data_parallel, training.expert_parallel, training.expert_tensor_parallel) == (4, 2, 1)
