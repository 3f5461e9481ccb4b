"""The 3D-HybridEngine's plan over routed experts, without a process: every legal (training, generation) pair
up to 8 ranks, against unit sets built from the parameter catalogue (what megatron's shards hold) and the
bound's formula; the placement against brute force; the refusals."""

from itertools import permutations

import pytest

from hybridengine.model.catalogue import ExpertShard, stage_params
from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.assignment import max_value_assignment
from hybridengine.reshard.expert_group import EXPERT_UNIT_ROWS, linear_bound, plan_experts
from hybridengine.reshard.plan import GenerationLayout, ReshardLayoutError, legal_generation_layouts
from test_moe_layout import QWEN3_MOE

SPEC = ModelSpec.from_hf_config(QWEN3_MOE)  # 8 experts of FFN 32, 4 layers, hidden 64
FFN, EXPERTS = 32, 8


def training_layouts(max_ranks: int = 8):
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            for dp in (1, 2, 4, 8):
                if tp * pp * dp > max_ranks:
                    continue
                for ep in (1, 2, 4, 8):
                    for etp in (1, 2, 4):
                        if (tp * dp) % (ep * etp) == 0 and EXPERTS % ep == 0:
                            yield ParallelLayout(tp, pp, dp, ep, etp)


def pairs():
    for train in training_layouts():
        for gen in legal_generation_layouts(train):
            for whole in (False, True):
                if (EXPERTS if whole else FFN) % gen.tensor_parallel == 0:
                    yield train, GenerationLayout(gen.tensor_parallel, gen.pipeline_parallel, whole)


PAIRS = list(pairs())


def held_by_catalogue(train: ParallelLayout, rank: int) -> set:
    """(layer, expert, unit) of every routed expert unit in ``rank``'s training shard, read from the catalogue's
    stage parameters (megatron's local experts, numbered globally) and the rank's ETP slice."""
    at = train.expert_coordinate(rank)
    units = set()
    for p in stage_params(SPEC, train.tp, train.pp, at.pp_rank, experts=ExpertShard(train.ep, at.ep_rank, train.etp)):
        if p.expert is not None and p.name.endswith("linear_fc2.weight"):
            width = p.shape[1]  # [hidden, FFN / ETP]
            units |= {(p.layer, p.expert, at.etp_rank * width + u) for u in range(width)}
    return units


def needed_by_formula(plan, rank: int, placement=None) -> set:
    placement = placement or plan.placement
    me = plan.layout.ranks[rank]
    gen = plan.gen
    layers = SPEC.layers_of_stage(me.gen_pp_rank, gen.pipeline_parallel)
    g, tg = me.gen_tp_rank, gen.tensor_parallel
    if gen.expert_parallel:
        slots = range(g * EXPERTS // tg, (g + 1) * EXPERTS // tg)
        return {(layer, placement[k], u) for layer in layers for k in slots for u in range(FFN)}
    return {(layer, e, u) for layer in layers for e in range(EXPERTS) for u in range(g * FFN // tg, (g + 1) * FFN // tg)}


def test_the_pairs_cover_every_expert_grid_and_both_generation_splits():
    assert len(PAIRS) > 200
    assert {(t.ep, t.etp) for t, _ in PAIRS} >= {(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (1, 4)}
    assert {g.expert_parallel for _, g in PAIRS} == {False, True}


@pytest.mark.parametrize("train,gen", PAIRS, ids=[f"{t}->{g}" for t, g in PAIRS])
def test_each_rank_receives_exactly_what_it_needs_and_does_not_hold(train, gen):
    plan = plan_experts(SPEC, train, gen)
    assert sorted(plan.placement) == list(range(EXPERTS))
    held = [held_by_catalogue(train, r) for r in range(train.world_size)]
    for rank in range(train.world_size):
        needs = plan.needs[rank]
        got = set()
        for need in needs:
            assert need.expert == plan.placement[need.slot]
            cursor = need.units[0]
            for piece in need.pieces:  # the pieces tile the needed units, in order
                assert (piece.layer, piece.expert) == (need.layer, need.expert) and piece.units[0] == cursor
                cursor = piece.units[1]
                units = {(piece.layer, piece.expert, u) for u in range(*piece.units)}
                assert units <= held[piece.source], (rank, piece)  # the sender holds what it sends
                assert (piece.source == rank) == (units <= held[rank])  # what a rank holds never travels
                got |= units
            assert cursor == need.units[1]
        needed = needed_by_formula(plan, rank)
        assert got == needed
        missing = len(needed - held[rank])
        unit_bytes = EXPERT_UNIT_ROWS * SPEC.hidden_size * 2
        assert plan.bytes_received(rank, 2) == plan.bound(rank, 2) == missing * unit_bytes
        assert sum(p.size for s in plan.receives(rank).values() for _, p in s) * unit_bytes == plan.bound(rank, 2)
        # The planner's closed form: the bound under the linear placement, which the plan's can only beat.
        linear = linear_bound(SPEC, plan.layout, rank, 2)
        if plan.placement == tuple(range(EXPERTS)):
            assert linear == plan.bound(rank, 2), (rank, linear)
        else:
            linear_missing = len(needed_by_formula(plan, rank, tuple(range(EXPERTS))) - held[rank])
            assert linear == linear_missing * unit_bytes, (rank, linear)
    # every piece sent is one received, in the same order on both sides
    for sender in range(train.world_size):
        for receiver, pieces in plan.sends(sender).items():
            assert pieces == plan.receives(receiver)[sender]


def total_held(train, gen, placement) -> int:
    """Units the generation shards take in place under ``placement`` (brute force over unit sets)."""
    plan = plan_experts(SPEC, train, gen)
    total = 0
    for rank in range(train.world_size):
        me = plan.layout.ranks[rank]
        slots = range(me.gen_tp_rank * EXPERTS // gen.tensor_parallel, (me.gen_tp_rank + 1) * EXPERTS // gen.tensor_parallel)
        needed = {(layer, placement[k], u) for layer in SPEC.layers_of_stage(me.gen_pp_rank, gen.pipeline_parallel)
                  for k in slots for u in range(FFN)}
        total += len(needed & held_by_catalogue(train, rank))
    return total


def test_whole_experts_are_placed_where_the_ranks_hold_them():
    # Training EP4 over four data-parallel ranks, generation TP2 with whole experts (two generation replicas):
    # vLLM's linear placement (experts 0-3 on generation rank 0) would leave rank 2 (experts 4-5) holding none
    # of its shard; the plan places 0, 1, 4, 5 on generation rank 0 and every rank holds half of what it needs.
    train, gen = ParallelLayout(1, 1, 4, 4, 1), GenerationLayout(2, 1, expert_parallel=True)
    plan = plan_experts(SPEC, train, gen)
    assert plan.placement == (0, 1, 4, 5, 2, 3, 6, 7)
    per_rank = 4 * 2 * FFN  # layers x held experts x units
    assert plan.held_bytes(1) == 4 * per_rank * EXPERT_UNIT_ROWS * SPEC.hidden_size
    linear = total_held(train, gen, tuple(range(EXPERTS)))
    assert linear == 2 * per_rank and total_held(train, gen, plan.placement) == 4 * per_rank
    assert all(plan.bound(r, 1) == 4 * 2 * FFN * EXPERT_UNIT_ROWS * SPEC.hidden_size for r in range(4))


@pytest.mark.parametrize("train,gen", [
    (ParallelLayout(1, 1, 8, 4, 1), GenerationLayout(4, 1, True)),
    (ParallelLayout(2, 1, 4, 4, 2), GenerationLayout(2, 1, True)),
    (ParallelLayout(2, 2, 2, 4, 1), GenerationLayout(2, 2, True)),
    (ParallelLayout(2, 1, 2, 2, 1), GenerationLayout(2, 1, True)),
])
def test_the_placement_holds_as_much_as_the_best_of_every_placement(train, gen):
    """Brute force over every placement of blocks of two experts (experts within a block never gain by moving
    apart here: each training EP rank holds two or more)."""
    plan = plan_experts(SPEC, train, gen)
    best = max(total_held(train, gen, tuple(2 * b + i for b in order for i in range(2)))
               for order in permutations(range(EXPERTS // 2)))
    assert total_held(train, gen, plan.placement) == best
    assert plan.held_bytes(1) == best * EXPERT_UNIT_ROWS * SPEC.hidden_size
    if total_held(train, gen, tuple(range(EXPERTS))) == best:
        assert plan.placement == tuple(range(EXPERTS))  # vLLM's own placement where nothing is gained


def test_the_assignment_is_the_best_of_every_permutation():
    import random

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 6)
        values = [[rng.randint(0, 5) for _ in range(n)] for _ in range(n)]
        job = max_value_assignment(values)
        assert sorted(job) == list(range(n))
        assert sum(values[w][job[w]] for w in range(n)) == max(
            sum(values[w][p[w]] for w in range(n)) for p in permutations(range(n)))
    assert max_value_assignment([[1, 1], [1, 1]]) == [0, 1]  # the identity where it is among the best
    with pytest.raises(ValueError, match="must be square"):
        max_value_assignment([[1, 2]])


def test_generation_layouts_the_experts_do_not_split_into_are_refused():
    train = ParallelLayout(1, 1, 8, 2, 1)
    with pytest.raises(ReshardLayoutError, match=r"expert parallelism over tensor_parallel=8 .* needs|valid sizes"):
        plan_experts(ModelSpec.from_hf_config({**QWEN3_MOE, "num_experts": 4}), train, GenerationLayout(8, 1, True))
    with pytest.raises(ReshardLayoutError, match=r"does not divide the experts' FFN hidden size 20; valid sizes: "
                                                 r"\[1, 2, 4, 5, 10, 20\], or whole experts"):
        plan_experts(ModelSpec.from_hf_config({**QWEN3_MOE, "moe_intermediate_size": 20}), ParallelLayout(1, 1, 8, 1, 1),
                     GenerationLayout(8, 1))
    with pytest.raises(ValueError, match="has no routed experts"):
        plan_experts(ModelSpec.from_hf_config({**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]}), train,
                     GenerationLayout(1))
