"""The micro-DP gather schedule, pure: executed here by simulating its collectives on every legal gather pair
up to 8 ranks, the generation buffer must equal the TP/PP join of the training shards (``join_tp_shards``,
an independent path), every rank must receive exactly its bound, and the units must be the ones the layout
allows (row-joined parameters in place, staging within the bucket)."""

import itertools

import pytest
import torch

from hybridengine.reshard.schedule import gather_schedule
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.model.spec import ModelSpec
from hybridengine.ops.copy_blocks import copy_blocks
from hybridengine.model.catalogue import ShardKind
from hybridengine.reshard.plan import GenerationLayout, legal_generation_layouts, plan_reshard
from hybridengine.reshard.weight_plan import (default_bucket_bytes, expected_bytes_received, generation_sources,
                                    in_place_min_bytes)
from hybridengine.device import CollectiveProfile
from hybridengine.model.catalogue import stage_params
from hybridengine.model.geometry import join_tp_shards


def _spec(tie=False, qkv_bias=False, layers=4):
    return ModelSpec.from_hf_config({
        "architectures": ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"], "hidden_act": "silu",
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": layers,
        "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": tie})


def _training_shards(spec, train):
    """Random, distinct training shards for every (tp, pp) of the layout; replicated tensors (norms) are the
    same on every TP rank of a stage, as in training."""
    g = torch.Generator().manual_seed(0)
    shards = {(tp, pp): {p.name: torch.randn(p.shape, generator=g) for p in stage_params(spec, train.tp, train.pp, pp)}
              for tp in range(train.tp) for pp in range(train.pp)}
    for (tp, pp), params in shards.items():
        for p in stage_params(spec, train.tp, train.pp, pp):
            if p.kind == ShardKind.REPLICATED:
                params[p.name] = shards[(0, pp)][p.name]
    return shards


def simulate(schedule, shards_of_member, rank_index):
    """Run ``schedule`` for every member at once; returns member ``rank_index``'s buffer and bytes received."""
    d_g = len(shards_of_member)
    buffer = torch.full((schedule.numel,), float("nan"))
    received = 0
    for piece, at in schedule.local:  # a member's own copy of what every member holds
        buffer[at: at + piece.length] = shards_of_member[rank_index][piece.name].reshape(-1)[piece.start:][:piece.length]
    for unit in schedule.units:
        parts = []
        for m, pieces in enumerate(unit.sends):
            flat = [shards_of_member[m][p.name].reshape(-1)[p.start: p.start + p.length] for p in pieces]
            parts.append(torch.cat(flat) if flat else torch.empty(0))
        if unit.collective == "all_gather":
            assert len(set(unit.sizes)) == 1, unit.sizes  # an all-gather moves equal parts
        received += sum(n for m, n in enumerate(unit.sizes) if m != rank_index)
        if unit.in_place:
            if unit.collective == "all_gather":  # member after member from the first target
                assert list(unit.targets) == [unit.targets[0] + m * unit.sizes[0] for m in range(d_g)]
            for t, part in zip(unit.targets, parts):
                if part.numel():
                    assert torch.isnan(buffer[t: t + part.numel()]).all()  # no byte written twice
                    buffer[t: t + part.numel()] = part
        else:
            before = torch.isnan(buffer).sum()
            copy_blocks(buffer, parts, unit.blocks)
            assert torch.isnan(buffer).sum() == before - unit.numel  # every staged element lands once
    return buffer, received


def _gather_pairs(max_world=8):
    for t, p, d in itertools.product((1, 2, 4), (1, 2, 4), (1, 2)):
        if t * p * d > max_world:
            continue
        train = ParallelLayout(t, p, d)
        for gen in legal_generation_layouts(train):
            plan = plan_reshard(train, gen)
            if plan.kind == "gather" and plan.micro_dp_size > 1:
                yield train, gen


PAIRS = list(_gather_pairs())


@pytest.mark.parametrize("in_place_min", [0, 1 << 40], ids=["in-place", "all-staged"])
@pytest.mark.parametrize("model", ["llama", "qwen2-tied"])
def test_every_gather_pair_builds_the_joined_shards_at_the_bound(model, in_place_min):
    spec = _spec(tie=model == "qwen2-tied", qkv_bias=model == "qwen2-tied")
    assert len(PAIRS) >= 20
    for train, gen in PAIRS:
        spec.check_layout(gen.tensor_parallel, gen.pipeline_parallel)
        plan = plan_reshard(train, gen)
        shards = _training_shards(spec, train)
        for rank in range(train.world_size):
            me = plan.ranks[rank]
            if me.micro_dp_index != 0 and rank % 3:
                continue  # every group from its first member, a few others too
            sources = generation_sources(spec, plan, rank)
            schedule = gather_schedule(sources, me.source_shards, 4, 4 << 10, in_place_min)
            members = [shards[src] for src in me.source_shards]
            buffer, received = simulate(schedule, members, me.micro_dp_index)
            assert not torch.isnan(buffer).any(), (train, gen)
            assert received * 4 == expected_bytes_received(spec, plan, rank, 4), (train, gen, rank)
            for s in sources:
                pieces = [members[m][name] for m, name in zip(s.members, s.train_names)]
                at = schedule.offsets[s.param.name]
                got = buffer[at: at + s.param.numel].view(s.param.shape)
                assert torch.equal(got, join_tp_shards(s.param.geometry, pieces)), (train, gen, s.param.name)
            assert schedule.staging_numel() * 4 <= (4 << 10) // 2  # rows of large parameters are cut apart


def _unit_of(schedule, sources, name):
    at = schedule.offsets[name]
    for unit in schedule.units:
        if unit.in_place and any(t <= at < t + n for t, n in zip(unit.targets, unit.sizes) if t >= 0):
            return unit
    return None


def test_row_joined_parameters_are_gathered_in_place_and_columns_are_staged():
    spec = _spec()
    plan = plan_reshard(ParallelLayout(4, 1, 1), GenerationLayout(1, 1))
    sources = generation_sources(spec, plan, 0)
    schedule = gather_schedule(sources, plan.ranks[0].source_shards, 4, 64 << 20, 1024)  # norms: 128 bytes
    kinds = {s.param.name: s.param.kind for s in sources}
    for name, kind in kinds.items():
        unit = _unit_of(schedule, sources, name)
        if kind in (ShardKind.VOCAB_ROWS, ShardKind.QKV, ShardKind.FC1):  # fc1: gate and up halves, one each
            assert unit is not None and unit.collective == "all_gather", name
        elif kind == ShardKind.COLUMNS:
            assert unit is None, name
    fc1 = [s.param.name for s in sources if s.param.kind == ShardKind.FC1]
    assert schedule.count("all_gather") == 2 * len(fc1) + sum(k in (ShardKind.VOCAB_ROWS, ShardKind.QKV)
                                                              for k in kinds.values())
    # The columns are packed into one staged all-gather; the norms, which every member holds, move not at all.
    assert schedule.count("all_gather+staged") == 1 and schedule.count("broadcast+staged") == 0
    assert sorted(p.name for p, _ in schedule.local) == sorted(n for n, k in kinds.items() if k == ShardKind.REPLICATED)


def test_a_pipeline_merge_gathers_stage_twins_side_by_side():
    """TP1 x PP4 -> TP1 x PP1: layer i of every stage is one all-gather into consecutive buffer ranges; the
    embedding and the output layer lie side by side, broadcast from the first and the last stage; the final
    norm, on the last stage only, is broadcast. Merging two stages, the embedding and the output layer are
    one all-gather."""
    spec = _spec()
    plan = plan_reshard(ParallelLayout(1, 4, 1), GenerationLayout(1, 1))
    sources = generation_sources(spec, plan, 0)
    schedule = gather_schedule(sources, plan.ranks[0].source_shards, 4, 64 << 20, 0)
    offsets = schedule.offsets
    for suffix in ("self_attention.linear_qkv.weight", "mlp.linear_fc2.weight"):
        names = [f"decoder.layers.{i}.{suffix}" for i in range(4)]
        numel = next(s.param.numel for s in sources if s.param.name == names[0])
        assert [offsets[n] - offsets[names[0]] for n in names] == [0, numel, 2 * numel, 3 * numel]
    assert offsets["output_layer.weight"] == offsets["embedding.word_embeddings.weight"] + 64 * 32
    assert [u.name for u in schedule.units if u.collective == "broadcast"] == ["broadcast", "broadcast"]
    assert schedule.units[0].sizes == (64 * 32, 0, 0, 64 * 32)  # the two edges, then the layers
    assert {u.name for u in schedule.units[1:-1]} == {"all_gather"}
    assert schedule.units[-1].sizes == (0, 0, 0, 32)  # the final norm
    two = plan_reshard(ParallelLayout(1, 2, 1), GenerationLayout(1, 1))
    schedule = gather_schedule(generation_sources(spec, two, 0), two.ranks[0].source_shards, 4, 64 << 20, 0)
    assert schedule.units[0].name == "all_gather" and schedule.units[0].sizes == (64 * 32, 64 * 32)


def test_small_parameters_are_packed_into_few_collectives():
    spec = _spec()
    plan = plan_reshard(ParallelLayout(2, 2, 2), GenerationLayout(1, 1))
    sources = generation_sources(spec, plan, 0)
    cpu = CollectiveProfile(latency_s=2.5e-3, link_bytes_per_s=2e9, copy_bytes_per_s=2e9)
    schedule = gather_schedule(sources, plan.ranks[0].source_shards, 4, default_bucket_bytes(cpu, 4),
                               in_place_min_bytes(cpu))
    # The whole tiny model: every equal part in one staged all-gather, the norms (first holder of each
    # merged stage) in one broadcast unit.
    assert [u.name for u in schedule.units] == ["all_gather+staged", "broadcast+staged"]
    one_stage = plan_reshard(ParallelLayout(4, 1, 2), GenerationLayout(2, 1))
    schedule = gather_schedule(generation_sources(spec, one_stage, 0), one_stage.ranks[0].source_shards, 4,
                               default_bucket_bytes(cpu, 2), in_place_min_bytes(cpu))
    assert [u.name for u in schedule.units] == ["all_gather+staged"] and schedule.local


def test_bucket_size_follows_the_link():
    slow = CollectiveProfile(latency_s=2.5e-3, link_bytes_per_s=2e9, copy_bytes_per_s=2e9)
    fast = CollectiveProfile(latency_s=10e-6, link_bytes_per_s=100e9, copy_bytes_per_s=1e12)
    assert default_bucket_bytes(slow, 4) == 64 << 20  # 16 latencies of 2 GB/s: more than the cap
    assert default_bucket_bytes(fast, 2) == 30 << 20  # 16 x 10 us x 100 GB/s / (1/2) = 32 MB: 30 whole MiB
    assert default_bucket_bytes(fast, 1) == 4 << 20
    assert in_place_min_bytes(slow) == 5_000_000 and in_place_min_bytes(fast) == 10_000_000
