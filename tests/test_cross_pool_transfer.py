"""The cross-pool transfer in real processes over gloo: the training pool's shards -> a generation pool.

Ranks 0..T-1 hold training shards read from the HF checkpoint; ranks T..T+G-1 are the generation
pool. Each generation rank must end with exactly its generation shard, bit-equal to the same slice
read from the checkpoint, and every rank must send and receive exactly the bytes the plan says
(the bound: M / (t_g p_g) into each generation rank, nothing into a training rank). A small bucket
makes each segment travel as several messages.
"""

import pytest
import torch

from dist_utils import run_cases_in_processes, run_in_processes
from test_resharder import shard_from_checkpoint
from tiny_models import make_llama

from hybridengine.cross_pool.plan import plan_for_model, segment_bytes
from hybridengine.cross_pool.transfer import CrossPoolTransfer
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.plan import GenerationLayout


def _worker(rank, world_size, path, train_dims, gen_dims, gen_dp, method, expect_method, bucket_bytes, store_port=None):
    spec = ModelSpec.from_pretrained(path)
    train, gen = ParallelLayout(*train_dims), GenerationLayout(*gen_dims)
    plan = plan_for_model(spec, train, gen, gen_dp, 4, method)
    assert plan.method == expect_method, plan.reason
    T = train.world_size
    assert world_size == T + plan.gen_world_size
    if store_port is None:  # one world for both pools (torchrun): a group of it
        transfer = CrossPoolTransfer(spec, plan, range(T), range(T, world_size), bucket_bytes=bucket_bytes)
    else:  # a world per pool (Ray): a process group of its own, meeting at the test's TCP store
        transfer = CrossPoolTransfer.standalone(spec, plan, rank, "127.0.0.1", store_port, 60, bucket_bytes)
    links = plan.link_bytes(segment_bytes(spec, plan, 4))
    if rank < T:
        coord = train.coordinate(rank)
        params = shard_from_checkpoint(path, spec, train.tp, train.pp, coord.tp_rank, coord.pp_rank)
        before = {k: v.clone() for k, v in params.items()}
        transfer.send(rank, params)
        assert transfer.bytes_sent == links.train_sent[rank] and transfer.bytes_received == 0
        assert all(torch.equal(params[k], v) for k, v in before.items())  # only read
    else:
        g = rank - T
        coord = plan.gen_coordinate(g)
        got = transfer.receive(g, torch.float32)
        expected = shard_from_checkpoint(path, spec, gen.tensor_parallel, gen.pipeline_parallel,
                                         coord.tp_rank, coord.pp_rank)
        assert list(got) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (rank, name)
            assert got[name].untyped_storage().data_ptr() == transfer.buffer.untyped_storage().data_ptr()
        shard = sum(t.numel() for t in expected.values()) * 4
        assert transfer.bytes_received == links.gen_received[g] == shard  # exactly the shard: the bound
        assert transfer.bytes_sent == links.gen_sent[g]
        assert transfer.buffer.numel() * 4 == shard  # no rank holds more than its shard


CASES = [  # (model, training t-p-d, generation t_g-p_g, replicas, method asked, method expected)
    ("llama", (2, 1, 2), (1, 1), 2, "auto", "p2p"),  # join TP shards; one training replica per generation one
    ("qwen2-tied", (2, 2, 1), (1, 1), 1, "auto", "p2p"),  # join stages too, tied embeddings
    ("llama", (1, 1, 2), (2, 1), 2, "auto", "broadcast"),  # slice, relayed down each replica chain
    ("llama", (2, 1, 1), (2, 1), 3, "auto", "broadcast"),  # same TP, many replicas
    ("qwen2-tied", (2, 1, 1), (2, 1), 3, "p2p", "p2p"),  # the same pair forced to p2p
    ("llama", (1, 2, 2), (1, 2), 2, "broadcast", "broadcast"),  # PP2 on both sides, forced broadcast
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross_pool")
    return {"llama": make_llama(root / "llama", heads=8, kv_heads=4),
            "qwen2-tied": make_llama(root / "qwen", tie=True, qkv_bias=True, heads=8, kv_heads=4)}


CASE_IDS = [f"{m}-{t}->{g}x{d}-{a}" for m, t, g, d, a, _ in CASES]


def world_of(train, gen, gen_dp) -> int:
    return train[0] * train[1] * train[2] + gen[0] * gen[1] * gen_dp


@pytest.fixture(scope="module")
def case_outcomes(models):
    """Every case, those of one world size in turn in one set of processes (3 sets for the 6 cases)."""
    outcomes = {}
    for world in sorted({world_of(t, g, d) for _, t, g, d, _, _ in CASES}):
        cases = {name: (str(models[m]), t, g, d, method, expect, 32 << 10)
                 for name, (m, t, g, d, method, expect) in zip(CASE_IDS, CASES) if world_of(t, g, d) == world}
        outcomes.update(run_cases_in_processes(_worker, world, cases))
    return outcomes


@pytest.mark.parametrize("model,train,gen,gen_dp,method,expect", CASES, ids=CASE_IDS)
def test_each_generation_rank_gets_exactly_its_shard_at_the_planned_bytes(case_outcomes, model, train, gen, gen_dp,
                                                                          method, expect):
    failure = case_outcomes[f"{model}-{train}->{gen}x{gen_dp}-{method}"]
    assert failure is None, failure


def test_the_transfer_over_a_process_group_outside_the_world(models):
    """As between two Ray pools, each its own world: a standalone group, meeting at a TCP store the
    controller (here the test) hosts."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run_in_processes(_worker, 2 + 4, str(models["llama"]), (2, 1, 1), (1, 1), 4, "auto", "broadcast", 32 << 10,
                     store.port)


# A mixture of experts: the dense part by the cross-pool plan, the routed experts point to point from the
# training ranks holding them (their group's pieces). (training t-p-d-EP-ETP, generation t_g-p_g-whole experts, replicas)
MOE_CASES = {
    "EP2xDP4->genTP1x2": ((1, 1, 4, 2, 1), (1, 1, False), 2),
    "TP2xDP2xEP2xETP1->genTP2": ((2, 1, 2, 2, 1), (2, 1, False), 1),
    "TP2xPP2xETP2->genTP1x2": ((2, 2, 1, 1, 2), (1, 1, False), 2),
    "EP4xDP4->genTP2xEP": ((1, 1, 4, 4, 1), (2, 1, True), 1),
}


def _moe_worker(rank, world_size, path, train_dims, gen_dims, gen_dp):
    from hybridengine.model.catalogue import ExpertShard, stage_params
    from hybridengine.model.hf_mapping import cut_shard, hf_source
    from workers.megatron.hf_checkpoint import HFCheckpointReader

    spec, read = ModelSpec.from_pretrained(path), HFCheckpointReader(path).read
    train, gen = ParallelLayout(*train_dims), GenerationLayout(*gen_dims)
    plan = plan_for_model(spec, train, gen, gen_dp, 4)
    T = train.world_size
    transfer = CrossPoolTransfer(spec, plan, range(T), range(T, world_size), bucket_bytes=32 << 10)
    links, experts = plan.link_bytes(segment_bytes(spec, plan, 4)), transfer.experts
    unit = 3 * spec.hidden_size * 4
    if rank < T:
        coord, at = train.coordinate(rank), train.expert_coordinate(rank)
        mine = ExpertShard(train.ep, at.ep_rank, train.etp)
        params = {p.name: cut_shard(hf_source(p.name, spec, coord.pp_rank, train.pp, mine), read, spec,
                                    at.etp_rank if p.expert is not None else coord.tp_rank,
                                    train.etp if p.expert is not None else train.tp)
                  for p in stage_params(spec, train.tp, train.pp, coord.pp_rank, experts=mine)}
        before = {k: v.clone() for k, v in params.items()}
        transfer.send(rank, params)
        expert_units = sum(p.size for pieces in experts.sends(rank).values() for _, p in pieces)
        assert transfer.bytes_sent == links.train_sent[rank] + expert_units * unit, rank
        assert all(torch.equal(params[k], v) for k, v in before.items())  # only read
        return
    g = rank - T
    coord = plan.gen_coordinate(g)
    got = transfer.receive(g, torch.float32)
    tg, pg = gen.tensor_parallel, gen.pipeline_parallel
    shard = ExpertShard(tg, coord.tp_rank, 1) if gen.expert_parallel else ExpertShard(1, 0, tg)
    params = stage_params(spec, tg, pg, coord.pp_rank, experts=shard)
    assert sorted(got) == sorted(p.name for p in params)
    ffn = spec.moe.expert_ffn_hidden_size
    a, b = (0, ffn) if gen.expert_parallel else (coord.tp_rank * ffn // tg, (coord.tp_rank + 1) * ffn // tg)
    for p in params:
        if p.expert is None:  # the dense part, cut at the generation layout
            want = cut_shard(hf_source(p.name, spec, coord.pp_rank, pg), read, spec, coord.tp_rank, tg)
        else:  # expert k of the generation shard is HF expert k (linear: nothing is held across pools)
            hf = f"model.layers.{p.layer}.mlp.experts.{p.expert}"
            want = (torch.cat([read(f"{hf}.gate_proj.weight")[a:b], read(f"{hf}.up_proj.weight")[a:b]])
                    if p.name.endswith("linear_fc1.weight") else read(f"{hf}.down_proj.weight")[:, a:b])
        assert torch.equal(got[p.name], want), (rank, p.name)
    # Exactly its shard: the dense bound and all of its experts, nothing more.
    assert transfer.bytes_received == links.gen_received[g] + experts.bound(g, 4), rank
    assert experts.bound(g, 4) == sum(got[p.name].numel() for p in params if p.expert is not None) * 4


def test_a_mixture_of_experts_crosses_pools_with_its_experts_point_to_point(tmp_path):
    from tiny_models import make_qwen3_moe

    model = str(make_qwen3_moe(tmp_path / "moe", layers=2, experts=8, expert_ffn=32, heads=8, kv_heads=4))
    outcomes = run_cases_in_processes(_moe_worker, 6, {name: (model, *dims) for name, dims in MOE_CASES.items()})
    assert all(failure is None for failure in outcomes.values()), outcomes
