"""The routed experts' executor in real gloo processes: every rank's generation experts against the HF
checkpoint's experts cut by hand (under the plan's placement), named as the catalogue names the generation
stage's experts, with the bytes received equal to the plan's bound; at generation TP1 the megatron rollout
engine on the resharded weights generates HF's greedy tokens. All cases share one launch of 8 processes."""

import pytest
import torch

from dist_utils import run_cases_in_processes
from hybridengine.model.catalogue import ExpertShard, stage_params
from hybridengine.model.hf_mapping import cut_shard, hf_source
from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.piece_mover import PieceMover
from hybridengine.reshard.plan import GenerationLayout
from hybridengine.reshard.transport import TorchTransport
from hybridengine.reshard.weight_plan import plan_weights
from tiny_models import make_qwen3_moe

# (training TP, PP, DP, EP, ETP) -> (generation TP, PP, whole experts per rank)
CASES = {
    "TP1xDP4xEP2->genTP2-slice": ((1, 1, 4, 2, 1), (2, 1, False)),
    "TP1xDP4xEP4->genTP2xEP-placed": ((1, 1, 4, 4, 1), (2, 1, True)),
    "TP2xDP2xEP2xETP2->genTP1": ((2, 1, 2, 2, 2), (1, 1, False)),
    "TP2xPP2xDP2xEP2xETP1->genTP2xPP1xEP": ((2, 2, 2, 2, 1), (2, 1, True)),
    "TP2xDP4xEP4xETP2->genTP4xEP-slice": ((2, 1, 4, 4, 2), (4, 1, True)),
    "TP1xPP2xDP4xEP4->genTP1xPP2": ((1, 2, 4, 4, 1), (1, 2, False)),
    "TP2xDP4xEP4xETP2->genTP1": ((2, 1, 4, 4, 2), (1, 1, False)),
}
PROMPTS = [(5, 17, 33), (9, 100, 4, 77, 12), (42,)]


def _generates_as_hf(rank, path, spec, plan, experts, reader, train):
    """The megatron rollout engine on the resharded weights (the dense part through the micro-DP plan, the
    experts as given): greedy tokens equal HF's, its log-probs HF's log-softmax, in fp32, and the experts it
    reports for every position it fed (prompt and response, all but the last token; each pipeline stage's
    layers joined) HF's routers' top-k on the same sequence."""
    from transformers import AutoModelForCausalLM

    from hybridengine.reshard.resharder import Resharder
    from workers.rollout.batch import GenerationRequest
    from workers.rollout.megatron_engine import MegatronGenerator
    from workers.rollout.sampling import SamplingConfig

    coord = train.coordinate(rank)
    dense = {p.name: cut_shard(hf_source(p.name, spec, coord.pp_rank, train.pp), reader.read, spec, coord.tp_rank, train.tp).clone()
             for p in plan.training_params(rank)}
    weights = {**Resharder(plan, rank, dense, TorchTransport()).to_generation(), **experts}
    generator = MegatronGenerator(spec, plan.layout, rank, {}, eos_token_id=255, pad_token_id=0,
                                  decode=lambda ids: " ".join(map(str, ids)), return_routed_experts=True)
    generator.update_weights(weights)
    out = generator.generate([GenerationRequest(p, None) for p in PROMPTS],
                             SamplingConfig(max_new_tokens=6, greedy=True, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, completion in zip(PROMPTS, out):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
            out = hf(torch.tensor([list(prompt) + ref]), output_router_logits=True)
            logits = out.logits[0, len(prompt) - 1: -1]
            # [positions, layers, k]: HF's routers' choice on every position but the last, ascending
            routes = torch.stack([r.topk(spec.moe.topk, -1).indices.sort(-1).values for r in out.router_logits], 1)[:-1]
        assert completion.token_ids == ref, (rank, prompt, completion.token_ids, ref)
        assert completion.routed_experts.shape == (len(prompt) + 5, 2, spec.moe.topk), completion.routed_experts.shape
        assert torch.equal(completion.routed_experts.long(), routes), (rank, prompt)
        picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ref).unsqueeze(-1)).squeeze(-1)
        assert (torch.tensor(completion.log_probs) - picked).abs().max() < 1e-4, (rank, prompt)


def _case(rank, world_size, path, train_dims, gen_dims):
    train, gen = ParallelLayout(*train_dims), GenerationLayout(*gen_dims)
    if rank >= train.world_size:
        return  # not in this case's world: the exchange is point to point, nothing to join
    from workers.megatron.hf_checkpoint import HFCheckpointReader

    reader = HFCheckpointReader(path)
    spec = ModelSpec.from_pretrained(path)
    weight_plan = plan_weights(spec, train, gen)
    plan = weight_plan.experts
    at = train.expert_coordinate(rank)
    mine = ExpertShard(train.ep, at.ep_rank, train.etp)
    params = {p.name: cut_shard(hf_source(p.name, spec, at.pp_rank, train.pp, mine), reader.read, spec, at.etp_rank,
                                train.etp)
              for p in stage_params(spec, train.tp, train.pp, at.pp_rank, experts=mine) if p.expert is not None}
    before = {k: v.clone() for k, v in params.items()}
    transport = TorchTransport()
    got = PieceMover.colocated(plan, rank, transport).move(params)

    me = plan.layout.ranks[rank]
    tg = gen.tensor_parallel
    shard = ExpertShard(tg, me.gen_tp_rank, 1) if gen.expert_parallel else ExpertShard(1, 0, tg)
    named = {p.name: p for p in stage_params(spec, tg, gen.pipeline_parallel, me.gen_pp_rank, experts=shard)
             if p.expert is not None}
    assert got.keys() == named.keys(), (rank, sorted(set(got) ^ set(named))[:4])
    ffn = spec.moe.expert_ffn_hidden_size
    a, b = (0, ffn) if gen.expert_parallel else (me.gen_tp_rank * ffn // tg, (me.gen_tp_rank + 1) * ffn // tg)
    for name, p in named.items():
        expert = plan.placement[p.expert]  # the catalogue numbers the generation experts; the plan places them
        hf = f"model.layers.{p.layer}.mlp.experts.{expert}"
        if name.endswith("linear_fc1.weight"):
            want = torch.cat([reader.read(f"{hf}.gate_proj.weight")[a:b], reader.read(f"{hf}.up_proj.weight")[a:b]])
        else:
            want = reader.read(f"{hf}.down_proj.weight")[:, a:b]
        assert tuple(got[name].shape) == p.shape and torch.equal(got[name], want), (rank, name)
    assert transport.bytes_received == plan.bound(rank, 4) == plan.bytes_received(rank, 4), (rank, transport.bytes_received)
    assert all(torch.equal(params[k], v) for k, v in before.items())  # training shards only read
    if gen.tensor_parallel == 1 and train.world_size == world_size:  # generation groups are made by the whole world
        _generates_as_hf(rank, path, spec, weight_plan, got, reader, train)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe"), layers=2, experts=8, expert_ffn=32, heads=8, kv_heads=4)


@pytest.fixture(scope="module")
def outcomes(checkpoint):
    return run_cases_in_processes(_case, 8, {name: (str(checkpoint), *dims) for name, dims in CASES.items()})


@pytest.mark.parametrize("case", CASES)
def test_generation_experts_equal_the_checkpoint_at_the_bound(outcomes, case):
    assert outcomes[case] is None, outcomes[case]


def test_a_placement_that_moves_experts_is_among_the_cases(checkpoint):
    spec = ModelSpec.from_pretrained(checkpoint)
    placed = plan_weights(spec, ParallelLayout(1, 1, 4, 4, 1), GenerationLayout(2, 1, True)).experts.placement
    assert placed != tuple(range(8))
