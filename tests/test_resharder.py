"""The resharding executor and both baselines in real gloo processes, against slices cut
independently from the HF checkpoint."""

import pytest
import torch

from dist_utils import run_cases_in_processes, run_in_processes
from hybridengine.model.hf_mapping import cut_shard, hf_source
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.baselines import BASELINES
from hybridengine.reshard.plan import GenerationLayout, plan_reshard
from hybridengine.reshard.generation_export import generation_to_hf
from hybridengine.reshard.resharder import Resharder
from hybridengine.reshard.weight_plan import WeightPlan, expected_bytes_received
from hybridengine.model.catalogue import stage_params
from hybridengine.reshard.transport import TorchTransport
from tiny_models import make_llama


def shard_from_checkpoint(path, spec, tp, pp, tp_rank, pp_rank):
    """What a rank holds at (tp_rank, pp_rank) of a TP x PP layout, read straight from the HF files."""
    from workers.megatron.hf_checkpoint import HFCheckpointReader

    reader = HFCheckpointReader(path)
    return {p.name: cut_shard(hf_source(p.name, spec, pp_rank, pp), reader.read, spec, tp_rank, tp).clone()
            for p in stage_params(spec, tp, pp, pp_rank)}


def _worker(rank, world_size, path, train_dims, gen_dims, bucket_bytes):
    spec = ModelSpec.from_pretrained(path)
    train = ParallelLayout(*train_dims)
    plan = plan_reshard(train, GenerationLayout(*gen_dims))
    coord = train.coordinate(rank)
    params = shard_from_checkpoint(path, spec, train.tp, train.pp, coord.tp_rank, coord.pp_rank)
    before = {k: v.clone() for k, v in params.items()}
    me = plan.ranks[rank]
    expected = shard_from_checkpoint(path, spec, gen_dims[0], gen_dims[1], me.gen_tp_rank, me.gen_pp_rank)

    transport = TorchTransport()
    resharder = Resharder(WeightPlan(spec, plan), rank, params, transport, bucket_bytes=bucket_bytes)
    got = resharder.to_generation()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), (rank, name)
    received = transport.bytes_received
    assert received == expected_bytes_received(spec, plan, rank, 4)
    # Full HF tensors of the generation stage, gathered over the generation TP group.
    from workers.megatron.hf_checkpoint import HFCheckpointReader

    hf = generation_to_hf(spec, plan, rank, got, TorchTransport())
    reader = HFCheckpointReader(path)
    stage_layers = spec.layers_of_stage(me.gen_pp_rank, gen_dims[1])
    for name, tensor in hf.items():
        if name.startswith("model.layers."):
            assert int(name.split(".")[2]) in stage_layers
        assert torch.equal(tensor, reader.read(name)), name
    assert sum(1 for n in hf if n.startswith("model.layers.")) == len(stage_layers) * (12 if spec.qkv_bias else 9)
    if plan.kind == "slice":
        assert transport.bytes_received == 0
    resharder.to_training()
    assert resharder.buffer is None and not resharder.weights
    for name, tensor in before.items():  # training shards were never touched
        assert torch.equal(params[name], tensor)
    if plan.kind == "gather":  # zero redundancy: the training shards give their memory up meanwhile
        again = resharder.to_generation(release_training=True)
        kept = [n for n, t in params.items() if t.untyped_storage().nbytes()]
        tied_copy = spec.tie_word_embeddings and gen_dims[1] == 1 and train.pp > 1
        assert kept == (["output_layer.weight"] if tied_copy and coord.pp_rank == train.pp - 1 else [])
        assert all(torch.equal(again[k], v) for k, v in expected.items())
        resharder.to_training()
        for name, tensor in before.items():
            assert torch.equal(params[name], tensor), name

    for name, baseline in BASELINES.items():
        t = TorchTransport()
        out = baseline(WeightPlan(spec, plan), rank, params, t)
        for key, tensor in expected.items():
            assert torch.equal(out[key], tensor), (name, rank, key)
        assert t.bytes_received >= received, (name, rank, t.bytes_received, received)


PAIRS = [  # (t, p, d) -> (t_g, p_g)
    ((2, 1, 2), (1, 1)), ((4, 1, 1), (2, 1)), ((4, 1, 1), (1, 1)), ((2, 2, 1), (1, 1)),
    ((2, 2, 1), (2, 1)), ((1, 2, 2), (1, 1)), ((2, 1, 2), (4, 1)), ((1, 4, 1), (1, 2)),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    # 8 heads in 4 KV groups: every TP size up to 4 divides the model.
    return {"llama": make_llama(root / "llama", heads=8, kv_heads=4),
            "qwen2-tied": make_llama(root / "qwen", tie=True, qkv_bias=True, heads=8, kv_heads=4)}


def pair_case(model, train, gen) -> str:
    return f"{model}-{train}->{gen}"


@pytest.fixture(scope="module")
def pair_outcomes(models):
    """Every (model, pair) case in turn in one set of 4 processes (each pair's world is 4 ranks)."""
    assert {t * p * d for (t, p, d), _ in PAIRS} == {4}
    # A small bucket forces several all-gathers per transition.
    cases = {pair_case(model, train, gen): (str(models[model]), train, gen, 64 << 10)
             for model in ("llama", "qwen2-tied") for train, gen in PAIRS}
    return run_cases_in_processes(_worker, 4, cases)


@pytest.mark.parametrize("train,gen", PAIRS, ids=[f"{t}->{g}" for t, g in PAIRS])
@pytest.mark.parametrize("model", ["llama", "qwen2-tied"])
def test_generation_weights_are_exact_slices_of_the_model(pair_outcomes, model, train, gen):
    failure = pair_outcomes[pair_case(model, train, gen)]
    assert failure is None, failure


def test_the_papers_eight_rank_example(models):
    run_in_processes(_worker, 8, str(models["llama"]), (4, 1, 2), (2, 1), 1 << 20)


class RecordingTransport(TorchTransport):
    """Notes where every all-gather writes: (storage pointer, first byte, bytes)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def all_gather_into(self, out, own, group_key, async_op=False):
        self.outputs.append((out.untyped_storage().data_ptr(), out.data_ptr(), out.numel() * out.element_size()))
        return super().all_gather_into(out, own, group_key, async_op)


def _in_place_worker(rank, world_size, path, train_dims, gen_dims, dtype):
    from hybridengine.device import CollectiveProfile
    from hybridengine.model.catalogue import ShardKind

    spec = ModelSpec.from_pretrained(path)
    train = ParallelLayout(*train_dims)
    plan = plan_reshard(train, GenerationLayout(*gen_dims))
    coord, me = train.coordinate(rank), plan.ranks[rank]
    dtype = getattr(torch, dtype)
    params = {k: v.to(dtype) for k, v in shard_from_checkpoint(path, spec, train.tp, train.pp, coord.tp_rank,
                                                              coord.pp_rank).items()}
    expected = {k: v.to(dtype) for k, v in shard_from_checkpoint(path, spec, gen_dims[0], gen_dims[1], me.gen_tp_rank,
                                                                me.gen_pp_rank).items()}
    transport = RecordingTransport()
    # A link with no fixed cost: every parameter the layout allows is gathered in place.
    resharder = Resharder(WeightPlan(spec, plan), rank, params, transport, profile=CollectiveProfile(1e-12, 1e9, 1e9))
    for attempt in range(2):
        transport.outputs.clear()
        got = resharder.to_generation(release_training=attempt == 1)
        assert all(got[k].dtype == dtype and torch.equal(got[k], v) for k, v in expected.items())
        storage = resharder.buffer.untyped_storage().data_ptr()
        row_joined = [s.param.name for s in resharder.sources if s.param.kind in (ShardKind.VOCAB_ROWS, ShardKind.QKV)]
        assert row_joined
        for name in row_joined:  # the all-gather wrote these bytes where the generation weight is: no second copy
            w = got[name]
            start, end = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
            assert w.untyped_storage().data_ptr() == storage, name
            assert any(s == storage and lo <= start and end <= lo + n for s, lo, n in transport.outputs), name
        first = resharder.buffer.data_ptr()
        resharder.to_training(offload=True)  # on CPU the buffer stays for the next transition
        assert resharder.buffer is not None and resharder.buffer.data_ptr() == first
    element = torch.empty(0, dtype=dtype).element_size()
    assert transport.bytes_received == 2 * expected_bytes_received(spec, plan, rank, element)  # at the bound, twice
    for name, tensor in shard_from_checkpoint(path, spec, train.tp, train.pp, coord.tp_rank, coord.pp_rank).items():
        assert torch.equal(params[name], tensor.to(dtype)), name  # released shards came back intact


@pytest.mark.parametrize("train,gen,dtype", [((4, 1, 1), (1, 1), "float32"), ((2, 2, 1), (1, 1), "bfloat16")],
                         ids=["tp4->1-fp32", "tp2pp2->1-bf16"])
def test_row_joined_parameters_are_gathered_into_the_generation_buffer(models, train, gen, dtype):
    run_in_processes(_in_place_worker, train[0] * train[1] * train[2], str(models["llama"]), train, gen, dtype)
