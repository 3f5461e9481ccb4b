"""A parameter group is one description: a toy group (an extra replicated norm in every decoder layer) goes
through the weight plan's planner and its executor as they are, at the bound, exact, in real gloo processes;
the dense shard read as a group gets the micro-DP gather's bound from the same planner, on every legal pair
(less the replicated norms the gather resends where stages merge: a rank holds its own), and the same
executor moves it exactly; and the catalogue's projections (what LoRA's shapes come from)
against the model's dimensions."""

import pytest
import torch

from dist_utils import run_cases_in_processes
from hybridengine.model.catalogue import REPLICATED, projections
from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.pieces import Holding, PieceGroup, Want, plan_pieces
from hybridengine.reshard.plan import GenerationLayout, legal_generation_layouts, plan_reshard
from tiny_models import make_llama, projection_shapes

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 8,
         "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 128, "head_dim": 16}
SPEC = ModelSpec.from_hf_config(LLAMA)


class ExtraNorm(PieceGroup):
    """One more RMSNorm weight in every decoder layer, the same on every TP rank of its stage: the whole group."""

    kind = "extra_norm"

    def __init__(self, spec, train: ParallelLayout, gen: GenerationLayout) -> None:
        self.spec, self.train, self.layout = spec, train, plan_reshard(train, gen)

    def wants(self, receiver):
        me = self.layout.ranks[receiver]
        return [Want(layer, layer, (0, 1))
                for layer in self.spec.layers_of_stage(me.gen_pp_rank, self.layout.gen.pipeline_parallel)]

    def holdings(self, layer):
        stage = self.spec.stage_of_layer(layer, self.train.pp)[0]
        return [Holding((0, 1), tuple(r for r in range(self.train.world_size)
                                      if self.train.coordinate(r).pp_rank == stage))]

    def geometries(self, layer):
        return (REPLICATED,)

    def shapes(self, layer, units):
        return ((self.spec.hidden_size,),)

    def training_names(self, train_rank, layer):
        stage = self.train.coordinate(train_rank).pp_rank
        return (f"decoder.layers.{self.spec.layers_of_stage(stage, self.train.pp).index(layer)}.extra_norm.weight",)

    def generation_names(self, receiver, need):
        me, gen = self.layout.ranks[receiver], self.layout.gen
        return (f"decoder.layers.{self.spec.layers_of_stage(me.gen_pp_rank, gen.pipeline_parallel).index(need.key)}"
                f".extra_norm.weight",)


def norm_of(layer: int) -> torch.Tensor:
    return torch.arange(SPEC.hidden_size, dtype=torch.float32) + 100 * layer


LAYOUTS = [((2, 2, 1), (1, 1)), ((2, 2, 1), (2, 2)), ((1, 4, 1), (1, 2)), ((1, 2, 2), (1, 1))]


@pytest.mark.parametrize("train,gen", LAYOUTS)
def test_a_new_group_is_planned_at_its_bound_by_the_planner_as_it_is(train, gen):
    train, gen = ParallelLayout(*train), GenerationLayout(*gen)
    group = ExtraNorm(SPEC, train, gen)
    plan = plan_pieces(group, train.world_size, colocated=True)
    for rank in range(train.world_size):
        own = set(SPEC.layers_of_stage(train.coordinate(rank).pp_rank, train.pp))
        wanted = set(SPEC.layers_of_stage(plan_reshard(train, gen).ranks[rank].gen_pp_rank, gen.pipeline_parallel))
        # the formula: the norms of the layers it wants and its stage does not hold, nothing else
        assert plan.bytes_received(rank, 4) == plan.bound(rank, 4) == len(wanted - own) * SPEC.hidden_size * 4
        for sender, pieces in plan.receives(rank).items():
            assert all(sender in group.holdings(p.key)[0].holders for _, p in pieces)  # senders hold what they send
    for sender in range(train.world_size):
        for receiver, pieces in plan.sends(sender).items():
            assert pieces == plan.receives(receiver)[sender]


def test_a_group_whose_holdings_miss_units_is_refused():
    class Short(ExtraNorm):
        def holdings(self, layer):
            return []

    with pytest.raises(ValueError, match=r"extra_norm 0: training holds only part of units \(0, 1\)"):
        plan_pieces(Short(SPEC, ParallelLayout(1, 1, 1), GenerationLayout(1)), 1, colocated=True)


def _move(rank, world_size, train_dims, gen_dims):
    from hybridengine.reshard.piece_mover import PieceMover
    from hybridengine.reshard.transport import TorchTransport

    train, gen = ParallelLayout(*train_dims), GenerationLayout(*gen_dims)
    group = ExtraNorm(SPEC, train, gen)
    plan = plan_pieces(group, world_size, colocated=True)
    stage = train.coordinate(rank).pp_rank
    params = {group.training_names(rank, layer)[0]: norm_of(layer) for layer in SPEC.layers_of_stage(stage, train.pp)}
    transport = TorchTransport()
    got = PieceMover.colocated(plan, rank, transport).move(params)
    me = plan_reshard(train, gen).ranks[rank]
    layers = SPEC.layers_of_stage(me.gen_pp_rank, gen.pipeline_parallel)
    assert sorted(got) == sorted(f"decoder.layers.{i}.extra_norm.weight" for i in range(len(layers)))
    for i, layer in enumerate(layers):
        assert torch.equal(got[f"decoder.layers.{i}.extra_norm.weight"], norm_of(layer)), (rank, layer)
    assert transport.bytes_received == plan.bound(rank, 4), (rank, transport.bytes_received)


def _move_dense(rank, world_size, path, train_dims, gen_dims):
    from hybridengine.reshard.dense_group import plan_dense
    from hybridengine.reshard.piece_mover import PieceMover
    from hybridengine.reshard.transport import TorchTransport
    from hybridengine.reshard.weight_plan import expected_bytes_received
    from test_resharder import shard_from_checkpoint

    spec, train, gen = ModelSpec.from_pretrained(path), ParallelLayout(*train_dims), GenerationLayout(*gen_dims)
    layout = plan_reshard(train, gen)
    coord, me = train.coordinate(rank), layout.ranks[rank]
    params = shard_from_checkpoint(path, spec, train.tp, train.pp, coord.tp_rank, coord.pp_rank)
    transport, plan = TorchTransport(), plan_dense(spec, layout)
    got = PieceMover.colocated(plan, rank, transport).move(params)
    want = shard_from_checkpoint(path, spec, gen.tensor_parallel, gen.pipeline_parallel, me.gen_tp_rank, me.gen_pp_rank)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (rank, name)
    assert transport.bytes_received == plan.bound(rank, 4) <= expected_bytes_received(spec, layout, rank, 4), rank


def _move_dense_across_pools(rank, world_size, path):
    """Training TP2 on ranks 0-1, two generation replicas at TP1 on ranks 2-3: the dense group through the same
    executor, each generation rank receiving its whole shard (the bound) from the ranks that hold it."""
    from hybridengine.cross_pool.plan import plan_cross_pool
    from hybridengine.reshard.dense_group import plan_dense_across_pools
    from hybridengine.reshard.piece_mover import PieceMover
    from hybridengine.reshard.transport import TorchTransport
    from test_resharder import shard_from_checkpoint

    spec, train = ModelSpec.from_pretrained(path), ParallelLayout(2, 1, 1)
    plan = plan_dense_across_pools(spec, plan_cross_pool(train, GenerationLayout(1), 2))
    transport = TorchTransport()
    if rank < 2:
        mover = PieceMover(plan, transport.exchange, rank, None, receiver_peer=lambda g: 2 + g)
        mover.move(shard_from_checkpoint(path, spec, 2, 1, rank, 0))
        assert transport.bytes_received == 0 and mover.bytes_sent > 0
        return
    mover = PieceMover(plan, transport.exchange, None, rank - 2, receiver_peer=lambda g: 2 + g)
    got = mover.move({}, torch.float32, "cpu")
    want = shard_from_checkpoint(path, spec, 1, 1, 0, 0)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (rank, name)
    assert transport.bytes_received == plan.bound(rank - 2, 4) == sum(t.numel() for t in want.values()) * 4


def _case(rank, world_size, which, *args):
    {"toy": _move, "dense": _move_dense, "across": _move_dense_across_pools}[which](rank, world_size, *args)


def test_a_new_group_and_the_dense_shard_move_exactly_through_the_one_executor_colocated_and_across_pools(tmp_path):
    model = str(make_llama(tmp_path / "llama", tie=True, heads=8, kv_heads=4))
    outcomes = run_cases_in_processes(_case, 4, {"toy": ("toy", (2, 2, 1), (1, 1)),
                                                 "dense": ("dense", model, (2, 2, 1), (1, 1)),
                                                 "dense-sliced": ("dense", model, (1, 1, 4), (2, 1)),
                                                 "dense-across-pools": ("across", model)})
    assert set(outcomes.values()) == {None}, outcomes


def fits(spec, tp: int, pp: int) -> bool:
    try:
        spec.check_layout(tp, pp)
    except ValueError:
        return False
    return True


def resent(spec, layout, rank, element_size) -> int:
    """What the micro-DP gather sends a rank that it already holds: where stages merge, a replicated tensor (a
    norm) of its own stage comes from the stage's first holder, not from its own copy."""
    from hybridengine.reshard.weight_plan import generation_sources

    me = layout.ranks[rank]
    if layout.kind == "slice" or len({pp for _, pp in me.source_shards}) == 1:
        return 0
    own = me.source_shards[me.micro_dp_index][1]
    return element_size * sum(s.param.numel for s in generation_sources(spec, layout, rank)
                              if s.param.geometry.replicated and s.stage == own and s.members[0] != me.micro_dp_index)


@pytest.mark.parametrize("config", [{}, {"tie_word_embeddings": True}, {"architectures": ["Qwen2ForCausalLM"],
                                                                          "num_key_value_heads": 8}])
def test_the_dense_shard_as_a_group_gets_the_micro_dp_bound_on_every_legal_pair(config):
    from hybridengine.reshard.dense_group import plan_dense
    from hybridengine.reshard.weight_plan import expected_bytes_received

    spec = ModelSpec.from_hf_config({**LLAMA, **config})
    pairs = 0
    for tp, pp, dp in [(1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1), (2, 2, 2), (4, 1, 2), (1, 4, 2), (4, 2, 1),
                       (2, 4, 1), (1, 2, 4)]:
        train = ParallelLayout(tp, pp, dp)
        if not fits(spec, tp, pp):
            continue
        for gen in legal_generation_layouts(train):
            if not fits(spec, gen.tensor_parallel, gen.pipeline_parallel):
                continue
            layout = plan_reshard(train, gen)
            plan = plan_dense(spec, layout)
            for rank in range(train.world_size):
                bound = expected_bytes_received(spec, layout, rank, 2)
                assert plan.bytes_received(rank, 2) == plan.bound(rank, 2) == bound - resent(spec, layout, rank, 2)
            pairs += 1
    assert pairs >= 19


def test_the_catalogue_gives_every_projection_its_shape_and_cut():
    for config in ({}, {"num_key_value_heads": 8}, {"head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 1}):
        spec = ModelSpec.from_hf_config({**LLAMA, **config})
        got = projections(spec)
        assert {p.part: (p.fan_in, p.fan_out) for p in got.values()} == projection_shapes(spec)
        assert {name for name, p in got.items() if p.row_parallel} == {"o_proj", "down_proj"}
        assert {p.linear for p in got.values()} == {"self_attention.linear_qkv", "self_attention.linear_proj",
                                                   "mlp.linear_fc1", "mlp.linear_fc2"}
