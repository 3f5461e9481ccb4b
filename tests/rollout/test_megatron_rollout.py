"""MegatronGenerator: megatron's static engine on the resharded weights, checked against HF transformers.

Real gloo processes hold training shards cut from a tiny HF checkpoint, the
Resharder turns them into generation layouts, and MegatronGenerator generates
on those buffers. Every output is compared with HF on the same weights:
greedy tokens with ``generate(do_sample=False)``, log-probs with an HF
forward's ``log_softmax(logits / T)``. One process launch runs several
layouts in turn (megatron's training grid is torn down and set up again).
"""

import json
import time
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_in_processes
from test_resharder import shard_from_checkpoint
from tiny_models import make_llama

from hybridengine.parallel.layout import ParallelLayout
from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.plan import GenerationLayout, plan_reshard
from hybridengine.reshard.resharder import Resharder
from hybridengine.reshard.weight_plan import WeightPlan
from hybridengine.reshard.transport import TorchTransport
from workers.rollout.batch import GenerationRequest
from workers.rollout.sampling import SamplingConfig

PROMPTS = [(5, 17, 33), (9, 100, 4, 77, 12, 8, 250, 3, 61), (42,), (7, 7, 200, 1, 90, 13)]


def _toy_decode(ids):
    return "".join(chr(ord("a") + t % 26) for t in ids)


class _Reference:
    """HF transformers on the checkpoint (optionally with some tensors scaled), fp32, eager attention."""

    def __init__(self, path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        self.model.generation_config.eos_token_id = None  # run the full length; truncation is checked separately
        self.model.generation_config.pad_token_id = 0

    @contextmanager
    def scaled(self, name, factor):
        """The model with one tensor times ``factor`` (a power of two, so undoing it is exact)."""
        tensor = self.model.get_parameter(name)
        with torch.no_grad():
            tensor.mul_(factor)
        try:
            yield self
        finally:
            with torch.no_grad():
                tensor.div_(factor)

    @torch.no_grad()
    def greedy(self, prompt, n):
        out = self.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()
        assert len(out) == n
        return out

    @torch.no_grad()
    def log_probs(self, prompt, tokens, temperature=1.0, top_k=-1):
        """log_softmax(logits / T) (restricted to the top k) at ``tokens``, and whether each is in the top k."""
        logits = self.model(torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
        logits = logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)] / temperature
        if top_k > 0:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
        return picked


def _first_stop(tokens, stop):
    for k in range(1, len(tokens) + 1):
        if stop in _toy_decode(tokens[:k]):
            return k
    return None


def _run_case(rank, path, train, gen, full):
    """All checks for one (training, generation) layout; returns numbers for the report."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from workers.rollout.megatron_engine import MegatronGenerator

    ps.initialize_model_parallel(tensor_model_parallel_size=train.tp, pipeline_model_parallel_size=train.pp)
    model_parallel_cuda_manual_seed(0)
    try:
        spec = ModelSpec.from_pretrained(path)
        plan = plan_reshard(train, gen)
        coord = train.coordinate(rank)
        params = shard_from_checkpoint(path, spec, train.tp, train.pp, coord.tp_rank, coord.pp_rank)
        resharder = Resharder(WeightPlan(spec, plan), rank, params, TorchTransport())
        weights = resharder.to_generation()
        groups = {}
        generator = MegatronGenerator(spec, plan, rank, groups, eos_token_id=255, pad_token_id=0, decode=_toy_decode)
        generator.update_weights(weights)
        storage = resharder.buffer.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        for name, p in generator.model.named_parameters():  # zero copy: parameters live in the reshard buffer
            assert start <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= end, name
        hf = _Reference(path)
        n = 8 if gen.pipeline_parallel == 1 else 5
        requests = [GenerationRequest(p, None) for p in PROMPTS]
        report = {}

        # 1. Greedy equals HF token for token; its log-probs are HF's log_softmax(logits).
        began = time.perf_counter()
        greedy = generator.generate(requests, SamplingConfig(max_new_tokens=n, greedy=True, ignore_eos=True))
        report["greedy_seconds"] = time.perf_counter() - began
        refs = [hf.greedy(p, n) for p in PROMPTS]
        assert [c.token_ids for c in greedy] == refs, ([c.token_ids for c in greedy], refs)
        assert all(c.finish_reason == "length" for c in greedy)
        diffs = [0.0]
        for p, c in zip(PROMPTS, greedy):
            diffs.append((torch.tensor(c.log_probs) - hf.log_probs(p, c.token_ids)).abs().max().item())

        # 2. Sampled tokens (T=0.7): log-probs of the tempered distribution, as HF computes them.
        sampling = SamplingConfig(max_new_tokens=n, temperature=0.7, ignore_eos=True)
        seeded = [GenerationRequest(p, 100 + i) for i, p in enumerate(PROMPTS)]
        sampled = generator.generate(seeded, sampling)
        for p, c in zip(PROMPTS, sampled):
            assert len(c.token_ids) == n
            diffs.append((torch.tensor(c.log_probs) - hf.log_probs(p, c.token_ids, 0.7)).abs().max().item())
        assert [c.token_ids for c in sampled] != refs  # it did sample

        if full:
            # Top-k: every token among HF's top 5, log-probs of the renormalised top-5 distribution.
            top5 = SamplingConfig(max_new_tokens=n, temperature=0.9, top_k=5, ignore_eos=True)
            topk = generator.generate(seeded, top5)
            for p, c in zip(PROMPTS, topk):
                ref = hf.log_probs(p, c.token_ids, 0.9, top_k=5)
                assert torch.isfinite(ref).all(), (p, c.token_ids)  # -inf: outside HF's top 5
                diffs.append((torch.tensor(c.log_probs) - ref).abs().max().item())
        report["max_logprob_diff"] = max(diffs)
        assert max(diffs) < 1e-4, diffs

        # 3. A seeded request's sample depends on its seed only: not on the call, its position or its
        # neighbours (here other prompt lengths, so its prompt is used up at another step of the loop).
        mixed = [GenerationRequest(PROMPTS[3], 7), seeded[1], GenerationRequest(PROMPTS[1], 99), seeded[0]]
        moved = generator.generate(mixed, sampling)
        assert moved[1].token_ids == sampled[1].token_ids and moved[3].token_ids == sampled[0].token_ids
        assert moved[1].log_probs == pytest.approx(sampled[1].log_probs, abs=1e-5)
        assert moved[2].token_ids != sampled[1].token_ids  # same prompt, another seed

        # Every rank of the world got the same seeded / greedy results, log-probs included; unseeded
        # samples (one seed per call from the group's first rank) agree within each generation group.
        unseeded = generator.generate(requests, sampling)
        mine = {"greedy": [(c.token_ids, c.log_probs) for c in greedy],
                "sampled": [(c.token_ids, c.log_probs) for c in sampled],
                "unseeded": [c.token_ids for c in unseeded], "replica": plan.ranks[rank].gen_dp_rank}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for other in everyone:
            for key in ("greedy", "sampled"):
                for (tokens, logps), (my_tokens, my_logps) in zip(other[key], mine[key]):
                    assert tokens == my_tokens and logps == pytest.approx(my_logps, abs=1e-6), key
            if other["replica"] == mine["replica"]:
                assert other["unseeded"] == mine["unseeded"]

        if full:
            # Megatron's scheduler running the requests two at a time changes nothing.
            generator.max_batch_size = 2
            halves = generator.generate(seeded, sampling)
            generator.max_batch_size = None
            assert [c.token_ids for c in halves] == [c.token_ids for c in sampled]
            _check_ends(rank, spec, plan, groups, weights, PROMPTS, refs)
            _check_unseeded(generator, sampling)
            _check_weight_updates(hf, generator, weights, refs, n)
        return report
    finally:
        ps.destroy_model_parallel()


def _check_ends(rank, spec, plan, groups, weights, prompts, refs):
    """4. EOS ends a response (included), stop strings end it, max_new_tokens caps it."""
    from workers.rollout.megatron_engine import MegatronGenerator

    n = len(refs[0])
    eos = refs[1][3]  # the 4th greedy token of prompt 1
    generator = MegatronGenerator(spec, plan, rank, groups, eos_token_id=eos, pad_token_id=0, decode=_toy_decode)
    generator.update_weights(weights)
    requests = [GenerationRequest(p, None) for p in prompts]
    out = generator.generate(requests, SamplingConfig(max_new_tokens=n, greedy=True))
    for ref, c in zip(refs, out):
        if eos in ref:
            assert c.token_ids == ref[: ref.index(eos) + 1] and c.finish_reason == "stop", (ref, c)
        else:
            assert c.token_ids == ref and c.finish_reason == "length", (ref, c)
    assert out[1].token_ids[-1] == eos and len(out[1].token_ids) <= 4
    ignored = generator.generate(requests, SamplingConfig(max_new_tokens=n, greedy=True, ignore_eos=True))
    assert [c.token_ids for c in ignored] == refs and all(c.finish_reason == "length" for c in ignored)

    stop = _toy_decode(refs[2][4:6])
    out = generator.generate(requests, SamplingConfig(max_new_tokens=n, greedy=True, ignore_eos=True, stop=(stop,)))
    for ref, c in zip(refs, out):
        k = _first_stop(ref, stop)
        assert c.token_ids == ref[: k or n] and c.finish_reason == ("stop" if k else "length"), (ref, stop, c)
    assert out[2].finish_reason == "stop" and len(out[2].token_ids) <= 6

    short = generator.generate([GenerationRequest(p, 5) for p in prompts],
                               SamplingConfig(max_new_tokens=3, greedy=True, ignore_eos=True))
    assert [c.token_ids for c in short] == [r[:3] for r in refs] and all(c.finish_reason == "length" for c in short)
    assert all(len(c.log_probs) == 3 for c in short)

    blind = MegatronGenerator(spec, plan, rank, groups, eos_token_id=eos, pad_token_id=0)
    with pytest.raises(ValueError, match=r"stop strings \['ab'\] need a decode function"):
        blind.generate(requests, SamplingConfig(stop=("ab",)))


def _check_unseeded(generator, sampling):
    """Unseeded requests follow the global torch RNG: reseeding repeats them, not reseeding does not."""
    requests = [GenerationRequest(p, None) for p in PROMPTS]
    torch.manual_seed(123)
    first = [c.token_ids for c in generator.generate(requests, sampling)]
    torch.manual_seed(123)
    assert [c.token_ids for c in generator.generate(requests, sampling)] == first
    assert [c.token_ids for c in generator.generate(requests, sampling)] != first


def _check_weight_updates(hf, generator, weights, refs, n):
    """5. New values in the buffer show at once; new tensors are re-bound without a copy."""
    requests = [GenerationRequest(p, None) for p in PROMPTS]
    greedy = SamplingConfig(max_new_tokens=n, greedy=True, ignore_eos=True)
    params = dict(generator.model.named_parameters())
    pointers = {k: p.data_ptr() for k, p in params.items()}
    generator.update_weights(weights)  # the same tensors: nothing to do
    assert {k: p.data_ptr() for k, p in params.items()} == pointers

    fc2 = "decoder.layers.1.mlp.linear_fc2.weight"
    weights[fc2].mul_(2.0)  # a training step writing into the shared buffer
    generator.update_weights(weights)
    out = [c.token_ids for c in generator.generate(requests, greedy)]
    with hf.scaled("model.layers.1.mlp.down_proj.weight", 2.0):
        expected = [hf.greedy(p, n) for p in PROMPTS]
    assert out == expected and out != refs, (out, expected, refs)
    weights[fc2].mul_(0.5)  # exact: back to the checkpoint

    proj = "decoder.layers.2.self_attention.linear_proj.weight"
    fresh = {**weights, proj: weights[proj] * 0.5}
    generator.update_weights(fresh)
    assert params[proj].data_ptr() == fresh[proj].data_ptr()
    out = [c.token_ids for c in generator.generate(requests, greedy)]
    with hf.scaled("model.layers.2.self_attn.o_proj.weight", 0.5):
        expected = [hf.greedy(p, n) for p in PROMPTS]
    assert out == expected and out != refs, (out, expected, refs)
    generator.update_weights(weights)  # back onto the reshard buffer
    assert params[proj].data_ptr() == weights[proj].data_ptr()
    assert [c.token_ids for c in generator.generate(requests, greedy)] == refs

    # Released, the model holds nothing of the buffer; installed again, it generates as before.
    generator.release()
    assert all(p.numel() == 0 for p in generator.model.parameters())
    generator.update_weights(weights)
    assert {k: p.data_ptr() for k, p in params.items()} == pointers
    assert [c.token_ids for c in generator.generate(requests, greedy)] == refs
    with pytest.raises(ValueError, match=r"linear_fc2\.weight: new weight is \(3, 3\) torch.float32 on cpu, the model"):
        generator.update_weights({**weights, fc2: torch.zeros(3, 3)})


def _worker(rank, world_size, path, cases, out_dir):
    from workers.megatron.megatron_compat import prepare_megatron

    prepare_megatron()
    results = {}
    for train_dims, gen_dims, full in cases:
        train, gen = ParallelLayout(*train_dims), GenerationLayout(*gen_dims)
        began = time.perf_counter()
        report = _run_case(rank, path, train, gen, full)
        results[f"{train}->{gen}"] = {**report, "case_seconds": time.perf_counter() - began}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 8 heads / 4 KV heads: generation TP2 from training TP4 keeps whole KV heads on each rank.
    return make_llama(tmp_path_factory.mktemp("rollout") / "llama", heads=8, kv_heads=4)


LAUNCHES = {
    # Two ranks: two independent generation replicas (TP1; this case runs every check) and one TP2 group.
    # A generation pipeline (TP2xPP2 -> PP2) runs through the Rollout role in test_rollout_engines.py, and
    # strided generation groups (TP4 -> TP2) in test_generation_model.py (the model) and for vLLM there.
    "2ranks-TP2->genTP1,genTP2": (2, [((2, 1, 1), (1, 1), True), ((2, 1, 1), (2, 1), False)]),
}


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_megatron_generator_matches_hf(model, tmp_path, launch):
    world, cases = LAUNCHES[launch]
    run_in_processes(_worker, world, str(model), cases, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for train_dims, gen_dims, _ in cases:
        key = f"{ParallelLayout(*train_dims)}->{GenerationLayout(*gen_dims)}"
        diffs = [r[key]["max_logprob_diff"] for r in results]
        assert max(diffs) < 1e-4
        greedy_seconds = max(r[key]["greedy_seconds"] for r in results)
        case_seconds = max(r[key]["case_seconds"] for r in results)
        print(f"{key}: max |log-prob diff| vs HF {max(diffs):.2e}, "
              f"first greedy call {greedy_seconds:.2f}s, case {case_seconds:.1f}s")


def test_top_k_top_p_match_hf_warpers():
    """The sampler's processed distribution is HF's temperature -> top-k -> top-p pipeline."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from workers.rollout.megatron_engine import _process_logits

    logits = torch.randn(6, 256, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in [(0.7, -1, 1.0), (1.0, 5, 1.0), (0.8, -1, 0.9), (1.3, 20, 0.5)]:
        ours = _process_logits(logits, temperature, top_k, top_p)
        ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k > 0:
            ref = TopKLogitsWarper(top_k)(None, ref)
        if top_p < 1.0:
            ref = TopPLogitsWarper(top_p)(None, ref)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (temperature, top_k, top_p)
        kept = ~torch.isinf(ref)
        assert torch.allclose(torch.log_softmax(ours, -1)[kept], torch.log_softmax(ref, -1)[kept], atol=1e-5)


def test_rejects_bad_settings(model):
    from workers.rollout.megatron_engine import MegatronGenerator

    spec = ModelSpec.from_pretrained(model)
    plan = plan_reshard(ParallelLayout(1, 1, 1), GenerationLayout(1, 1))
    with pytest.raises(ValueError, match=r"eos_token_id must be a token id in \[0, 256\), got 256"):
        MegatronGenerator(spec, plan, 0, {}, eos_token_id=256, pad_token_id=0)
    with pytest.raises(ValueError, match="max_batch_size must be None or a positive integer, got 0"):
        MegatronGenerator(spec, plan, 0, {}, eos_token_id=2, pad_token_id=0, max_batch_size=0)
    generator = MegatronGenerator(spec, plan, 0, {}, eos_token_id=2, pad_token_id=0)
    with pytest.raises(ValueError, match="request 1 has an empty prompt"):
        generator.generate([GenerationRequest((1, 2), None), GenerationRequest((), None)], SamplingConfig())
    with pytest.raises(ValueError, match=r"request 0: prompt token ids \[300\] are outside the vocabulary"):
        generator.generate([GenerationRequest((1, 300), None)], SamplingConfig())
    with pytest.raises(RuntimeError, match="before update_weights"):
        generator.generate([GenerationRequest((1, 2), None)], SamplingConfig())
    assert generator.generate([], SamplingConfig()) == []
