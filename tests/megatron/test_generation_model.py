"""A megatron GPTModel at the generation layout, over the resharded buffer, gives HF's logits."""

import json

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_cases_in_processes, run_in_processes
from test_resharder import shard_from_checkpoint
from tiny_models import make_llama

from hybridengine.parallel.layout import ParallelLayout
from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.plan import GenerationLayout, plan_reshard
from hybridengine.reshard.resharder import Resharder
from hybridengine.reshard.weight_plan import WeightPlan
from hybridengine.reshard.transport import TorchTransport


def _worker(rank, world_size, path, train_dims, gen_dims, out_dir):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from workers.megatron.generation_model import (
        build_generation_model,
        generation_logits,
    )
    from workers.megatron.megatron_compat import prepare_megatron

    prepare_megatron()
    train = ParallelLayout(*train_dims)
    # The training grid owns megatron's globals, as in the real engine; the generation model must not use them.
    ps.initialize_model_parallel(tensor_model_parallel_size=train.tp, pipeline_model_parallel_size=train.pp)
    model_parallel_cuda_manual_seed(0)
    try:
        spec = ModelSpec.from_pretrained(path)
        plan = plan_reshard(train, GenerationLayout(*gen_dims))
        coord = train.coordinate(rank)
        params = shard_from_checkpoint(path, spec, train.tp, train.pp, coord.tp_rank, coord.pp_rank)
        resharder = Resharder(WeightPlan(spec, plan), rank, params, TorchTransport())
        weights = resharder.to_generation()
        groups = {}
        model = build_generation_model(spec, plan, rank, weights, groups)
        created = dict(groups)
        build_generation_model(spec, plan, rank, weights, groups)  # a rebuild reuses every group
        assert groups == created

        # Zero copy: every parameter lies inside the resharder's flat buffer.
        storage = resharder.buffer.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        for name, p in model.named_parameters():
            assert not p.requires_grad, name
            assert p.data_ptr() == weights[name].data_ptr(), name
            assert start <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= end, name
        assert ps.get_tensor_model_parallel_world_size() == train.tp  # globals untouched

        input_ids = torch.randint(0, spec.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
        logits = generation_logits(model, input_ids)
        last_stage = plan.ranks[rank].gen_pp_rank == gen_dims[1] - 1
        assert (logits is not None) == last_stage
        if last_stage:
            assert logits.shape == (3, 11, spec.vocab_size // gen_dims[0])
            tp_group = model.pg_collection.tp
            parts = [torch.empty_like(logits) for _ in range(tp_group.size())]
            dist.all_gather(parts, logits.contiguous(), group=tp_group)
            full = torch.cat(parts, dim=-1)
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
            with torch.no_grad():
                ref = hf(input_ids).logits
            diff = (full - ref).abs().max().item()
            with open(f"{out_dir}/diff{rank}.json", "w") as f:
                json.dump(diff, f)
            assert diff < 1e-4, (rank, diff)
        # The forward reads the buffer itself: zeroed weights (final norm included) give zero logits.
        resharder.buffer.zero_()
        logits = generation_logits(model, input_ids)
        if last_stage:
            assert torch.count_nonzero(logits) == 0
    finally:
        ps.destroy_model_parallel()


CASES = [  # (model, (t, p, d), (t_g, p_g))
    ("llama", (4, 1, 1), (2, 1)),
    ("qwen2-tied", (2, 2, 1), (1, 2)),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("genmodel")
    return {"llama": make_llama(root / "llama", heads=8, kv_heads=4),
            "qwen2-tied": make_llama(root / "qwen", tie=True, qkv_bias=True, heads=8, kv_heads=4)}


CASE_IDS = [f"{m}-{t}->{g}" for m, t, g in CASES]


@pytest.fixture(scope="module")
def case_runs(models, tmp_path_factory):
    """Both cases in turn in one set of 4 processes: name -> (failure or None, the case's output directory)."""
    assert {t * p * d for _, (t, p, d), _ in CASES} == {4}
    outs = {name: tmp_path_factory.mktemp(name.replace(">", "")) for name in CASE_IDS}
    cases = {name: (str(models[m]), train, gen, str(outs[name])) for name, (m, train, gen) in zip(CASE_IDS, CASES)}
    outcomes = run_cases_in_processes(_worker, 4, cases)
    return {name: (outcomes[name], outs[name]) for name in CASE_IDS}


@pytest.mark.parametrize("model,train,gen", CASES, ids=CASE_IDS)
def test_generation_model_matches_hf_logits(case_runs, model, train, gen):
    failure, out = case_runs[f"{model}-{train}->{gen}"]
    assert failure is None, failure
    diffs = [json.loads(p.read_text()) for p in out.glob("diff*.json")]
    assert len(diffs) == train[0] * train[1] * train[2] // gen[1]  # one per last-stage rank
    print(f"max |logit diff| vs HF: {max(diffs):.3g}")


def test_rejects_a_non_monotonic_generation_group():
    from workers.megatron.generation_model import generation_process_groups

    plan = plan_reshard(ParallelLayout(2, 1, 2), GenerationLayout(4, 1))  # slice: TP group (0, 2, 1, 3)
    assert any(list(g) != sorted(g) for g in plan.gen_tp_groups)
    with pytest.raises(ValueError, match="increasing rank order"):
        generation_process_groups(plan, 0, {})


def _mismatch_worker(rank, world_size, path):
    from workers.megatron.generation_model import build_generation_model
    from workers.megatron.megatron_compat import prepare_megatron

    prepare_megatron()
    spec = ModelSpec.from_pretrained(path)
    plan = plan_reshard(ParallelLayout(1, 1, 1), GenerationLayout(1, 1))
    weights = shard_from_checkpoint(path, spec, 1, 1, 0, 0)
    groups = {}
    bad = {**weights, "decoder.layers.1.mlp.linear_fc2.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.mlp\.linear_fc2\.weight: generation shard has \(3, 3\)"):
        build_generation_model(spec, plan, rank, bad, groups)
    missing = {k: v for k, v in weights.items() if k != "decoder.final_layernorm.weight"}
    with pytest.raises(ValueError, match=r"'decoder\.final_layernorm\.weight' has no tensor"):
        build_generation_model(spec, plan, rank, missing, groups)
    extra = {**weights, "decoder.layers.9.mlp.linear_fc2.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"'decoder\.layers\.9\.mlp\.linear_fc2\.weight' is not a parameter"):
        build_generation_model(spec, plan, rank, extra, groups)


def test_names_and_shapes_must_match(models):
    run_in_processes(_mismatch_worker, 1, str(models["llama"]))
