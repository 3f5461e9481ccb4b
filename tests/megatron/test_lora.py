"""LoRA adapters on megatron's tensor-parallel linears against HF PEFT, in real gloo processes.

The same tiny Llama and the same adapters (PEFT's, with random B so that they change the output): the
logits of megatron's stage with ``attach_lora`` at TP1 and TP2 equal PEFT's model's to 1e-5, and so do the
adapters' gradients of one loss (within fp32 rounding of the backward's chain of sums, ``tolerances``), cut to
each rank's shard (fused QKV and gated fc1 interleaved as megatron
lays them out; the row-parallel adapters' partial products summed over TP); the merged weights equal PEFT's
merge_and_unload() cut to the shard, bit for bit; the adapters gathered whole and written as a PEFT adapter
directory load in peft and give PEFT's logits. The base is frozen.
Config checks, with no process.
"""

import pytest
import torch

from dist_utils import run_cases_in_processes
from peft_reference import peft_with_random_b
from tiny_models import make_llama
from tolerances import summation_tolerance

RANK, ALPHA = 4, 8.0
HF = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
      "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def _peft_model(path):
    from transformers import AutoModelForCausalLM

    return peft_with_random_b(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), RANK, ALPHA)


def _inputs(spec):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, spec.vocab_size, (2, 12), generator=g)
    probe = torch.randn(2, 12, spec.vocab_size, generator=g)
    return ids, probe


def _reference(path, out):
    """PEFT's logits and adapter gradients of sum(logits * probe), saved for the processes."""
    from hybridengine.model.spec import ModelSpec

    peft = _peft_model(path)
    ids, probe = _inputs(ModelSpec.from_pretrained(path))
    base = {n: t.clone() for n, t in peft.get_base_model().state_dict().items()}
    logits = peft(ids).logits
    (logits * probe).sum().backward()
    adapters = {n: p.detach().clone() for n, p in peft.named_parameters() if "lora_" in n}
    grads = {n: p.grad.clone() for n, p in peft.named_parameters() if "lora_" in n}
    peft.save_pretrained(str(out.parent / "peft_adapter"))  # what a LoRA engine starts from (lora.adapter_path)
    merged = {n: t.clone() for n, t in peft.merge_and_unload().state_dict().items()}  # PEFT's own merge, in HF names
    base = {n.replace(".base_layer", ""): t for n, t in base.items() if "lora_" not in n}
    torch.save({"logits": logits.detach(), "adapters": adapters, "grads": grads, "merged": merged, "base": base}, out)


def _hf_name(layer: int, part: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{HF[part]}.{which}.default.weight"


def _shard(tensor, part: str, which: str, tp_rank: int, tp: int):
    """This rank's cut of PEFT's A or B: a column linear's B by its output rows, a row linear's A by its input
    columns; the rest replicated."""
    if which == "lora_B" and part not in ("o", "down"):
        n = tensor.shape[0] // tp
        return tensor[tp_rank * n: (tp_rank + 1) * n]
    if which == "lora_A" and part in ("o", "down"):
        n = tensor.shape[1] // tp
        return tensor[:, tp_rank * n: (tp_rank + 1) * n]
    return tensor


def _case(rank, world_size, path, reference, tp, export_dir):
    from hybridengine.model.spec import ModelSpec
    from workers.megatron.config import EngineConfig
    from workers.megatron.engine import MegatronEngine
    from hybridengine.model.hf_mapping import cut_shard, hf_source
    from workers.megatron.lora import LoRAConfig, attach_lora, lora_parameters, merged_weights
    from workers.megatron.lora_peft import full_adapters, save_peft_adapter

    ref = torch.load(reference, weights_only=False)
    spec = ModelSpec.from_pretrained(path)
    engine = MegatronEngine(path, EngineConfig(tensor_parallel=tp, precision="fp32"), world_size)
    module, tp_rank = engine.module(), engine.groups.tp_rank
    adapters = attach_lora(module, spec, LoRAConfig(rank=RANK, alpha=ALPHA), tp, engine.groups.tp_group, tp_rank)
    assert len(adapters) == 4 * spec.num_layers  # per layer: linear_qkv (q, k, v), linear_proj, linear_fc1, linear_fc2
    with torch.no_grad():
        for name, adapter in adapters.items():
            layer = int(name.split("decoder.layers.", 1)[1].split(".", 1)[0])
            for which, params in (("lora_A", adapter.lora_A), ("lora_B", adapter.lora_B)):
                for part, p in params.items():
                    p.copy_(_shard(ref["adapters"][_hf_name(layer, part, which)], part, which, tp_rank, tp))
    trained = lora_parameters(module)
    assert trained and all(p.requires_grad for p in trained.values())
    assert not any(p.requires_grad for n, p in module.named_parameters() if n not in trained)  # the base frozen
    # Exported whole, under PEFT's names: what a PEFT adapter directory holds (the test loads it in peft).
    whole = full_adapters(module, spec, tp, engine.groups.tp_group)
    assert sorted(whole) == sorted(k.replace(".default", "") for k in ref["adapters"])
    if rank == 0:
        save_peft_adapter(whole, LoRAConfig(rank=RANK, alpha=ALPHA), export_dir, path)
    # Merged: each adapted weight equals PEFT's merge_and_unload() cut to this rank's shard, bit for bit.
    merged = merged_weights(module)
    assert len(merged) == 4 * spec.num_layers
    for name, weight in merged.items():
        want = cut_shard(hf_source(name, spec, 0, 1), lambda hf, index: ref["merged"][hf][index], spec, tp_rank, tp)
        assert torch.equal(weight, want), name
    assert not any(torch.equal(merged[n], p) for n, p in module.named_parameters() if n in merged)  # they moved
    ids, probe = _inputs(spec)
    position_ids = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    local = module(ids, position_ids, None)  # [b, s, padded vocab / tp]
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.detach(), group=engine.groups.tp_group)
    logits = torch.cat(parts, -1)[..., : spec.vocab_size]
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=0)
    width = local.shape[-1]
    mine = torch.nn.functional.pad(probe, (0, width * tp - spec.vocab_size))[..., tp_rank * width: (tp_rank + 1) * width]
    (local * mine).sum().backward()
    # Each adapter gradient is fp32 rounding apart from PEFT's: the backward's sums run in another order (TP2's
    # partial products summed over ranks, fused QKV and fc1, this CPU's vector width). Its chain of sums: the
    # probe over the vocabulary, each layer's hidden, intermediate and sequence widths, then the batch's tokens
    # for the weight gradient. The bound is on the tensor's scale: a small element cancels large terms (one
    # element of 4e-3 in a fc1 gate gradient moved by 1.35e-5, past the former fixed 1e-5).
    chain = spec.vocab_size + spec.num_layers * (spec.hidden_size + spec.ffn_hidden_size + ids.shape[1]) + ids.numel()
    for name, adapter in adapters.items():
        layer = int(name.split("decoder.layers.", 1)[1].split(".", 1)[0])
        for which, params in (("lora_A", adapter.lora_A), ("lora_B", adapter.lora_B)):
            for part, p in params.items():
                want = _shard(ref["grads"][_hf_name(layer, part, which)], part, which, tp_rank, tp)
                bound = summation_tolerance(chain, float(want.abs().max()))
                torch.testing.assert_close(p.grad, want, atol=bound, rtol=0, msg=lambda m: f"{name} {which} {part}: {m}")


def _generation_case(rank, world_size, path, reference, tp, gen_tps):
    """A LoRA engine's generation weights through the hybrid engine: the adapted linears equal PEFT's merge cut
    to the generation layout, bit for bit; a second sync moves only the adapters' bytes."""
    from pathlib import Path

    from controller.planner.memory import lora_gather_bytes, lora_merged_bytes, weight_bytes
    from hybridengine.model.hf_mapping import cut_shard, hf_source
    from hybridengine.model.spec import ModelSpec
    from hybridengine.reshard.plan import GenerationLayout
    from workers.megatron.config import EngineConfig, OptimConfig
    from workers.megatron.engine import MegatronEngine
    from workers.megatron.hybrid_bridge import HybridBridge
    from workers.megatron.lora import LoRAConfig

    ref = torch.load(reference, weights_only=False)
    adapter_dir = str(Path(reference).parent / "peft_adapter")
    engine = MegatronEngine(path, EngineConfig(tensor_parallel=tp, precision="fp32"), world_size, OptimConfig(),
                            lora=LoRAConfig(rank=RANK, alpha=ALPHA, adapter_path=adapter_dir))
    spec = ModelSpec.from_pretrained(path)
    bridge = HybridBridge(engine)
    adapted = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
    # what gathering the adapters whole receives: the other TP ranks' pieces of each cut side (fp32)
    cut_sides = [t for n, t in ref["adapters"].items() if ("lora_B" in n) != any(r in n for r in ("o_proj", "down_proj"))]
    gathered = sum(t.numel() * 4 for t in cut_sides) * (tp - 1) // tp
    for gen_tp in gen_tps:
        gen = GenerationLayout(gen_tp)
        first = bridge.to_generation(gen)
        weights = dict(bridge.weights)
        assert sum(name.endswith(adapted) for name in weights) == 4 * spec.num_layers
        for name, tensor in weights.items():
            if name.endswith(adapted):
                want = cut_shard(hf_source(name, spec, 0, 1), lambda hf, index: ref["merged"][hf][index], spec,
                                 first["gen_tp_rank"], gen_tp)
                assert torch.equal(tensor, want), (gen_tp, name)
        # The planner's figures of what the sync keeps (controller.planner.options._lora_generation): the merged
        # linears' buffer, and the base's generation shard, a copy of its own only where a micro-DP group gathers
        # it (at the training layout, the training shards themselves).
        targets = engine.lora.targets
        kept = bridge.merged[gen]
        assert sum(t.numel() * t.element_size() for t in kept.values()) == lora_merged_bytes(spec, gen_tp, 1, "fp32",
                                                                                             targets)
        training = [p.data for p in engine.module().parameters()]
        base = bridge.base[gen].values()
        copied = sum(t.numel() * t.element_size() for t in base
                     if not any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in training))
        if gen_tp < tp:  # gathered: all of it
            assert copied == weight_bytes(engine.spec, gen_tp, 1, "fp32")
        elif gen_tp > tp:  # sliced: fc1 alone, its gate and up halves joined again
            assert copied == lora_merged_bytes(spec, gen_tp, 1, "fp32", ("gate_proj", "up_proj"))
        else:
            assert copied == 0
        bridge.to_training()
        second = bridge.to_generation(gen)  # the base is where it was: only the adapters move
        assert second["reshard/bytes_received"] == second["reshard/lora_bytes_received"]
        assert second["reshard/lora_bytes_received"] == gathered
        assert gathered == lora_gather_bytes(spec, tp, 1, "fp32", RANK, targets)
        if gen_tp < tp:
            assert first["reshard/bytes_received"] > 20 * second["reshard/bytes_received"]
        bridge.to_training()
    with torch.no_grad():  # adapters at zero: the generation weights are the base again, exactly
        for adapter in engine.adapters.values():
            for b in adapter.lora_B.values():
                b.zero_()
    info = bridge.to_generation(GenerationLayout(gen_tps[0]))
    for name, tensor in bridge.weights.items():
        if name.endswith(adapted):
            want = cut_shard(hf_source(name, spec, 0, 1), lambda hf, index: ref["base"][hf][index], spec,
                             info["gen_tp_rank"], gen_tps[0])
            assert torch.equal(tensor, want), name


def _either(rank, world_size, case, *args):
    case(rank, world_size, *args)


def test_lora_on_the_parallel_linears_matches_peft_at_tp1_and_tp2(tmp_path):
    model = make_llama(tmp_path / "llama", heads=4, kv_heads=2, head_dim=16, layers=2)
    reference = tmp_path / "peft.pt"
    _reference(str(model), reference)
    outcomes = run_cases_in_processes(_either, 2, {
        "TP1xDP2": (_case, str(model), str(reference), 1, str(tmp_path / "tp1")),
        "TP2": (_case, str(model), str(reference), 2, str(tmp_path / "tp2")),
        "generation: TP2 to genTP1, genTP2": (_generation_case, str(model), str(reference), 2, (1, 2)),
        "generation: TP1xDP2 to genTP1, genTP2": (_generation_case, str(model), str(reference), 1, (1, 2))})
    assert all(failure is None for failure in outcomes.values()), outcomes
    # The exported adapter directories load in PEFT onto the base and give the reference's logits.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridengine.model.spec import ModelSpec

    ids, _ = _inputs(ModelSpec.from_pretrained(model))
    want = torch.load(reference, weights_only=False)["logits"]
    for exported in ("tp1", "tp2"):
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                           str(tmp_path / exported))
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, want, atol=1e-5, rtol=0)


def test_lora_settings_are_checked_with_every_problem_named():
    from hybridengine.model.spec import ModelSpec
    from workers.megatron.lora import LoRAConfig, check_lora
    from test_moe_layout import QWEN3_MOE

    with pytest.raises(ValueError) as bad:
        LoRAConfig(rank=-1, alpha=0, dropout=1.0, target_modules=["q_proj", "qkv"])
    for part in ("rank must be a non-negative integer", "alpha must be a positive number", "dropout must be in [0, 1)",
                 "unknown ['qkv']; valid: ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', "
                 "'down_proj'] or 'all-linear'"):
        assert part in str(bad.value)
    assert not LoRAConfig().enabled and LoRAConfig(rank=8, alpha=16).scaling == 2.0
    assert LoRAConfig(rank=8, target_modules="all-linear").targets == tuple(HF_TARGETS)
    dense = ModelSpec.from_hf_config({**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ValueError, match=r"must take \['q_proj', 'k_proj', 'v_proj'\] together .*got \['q_proj'\]"):
        check_lora(dense, LoRAConfig(rank=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"LoRA rank 512 exceeds q_proj's dimensions \(64 in, 64 out\); use a rank of "
                                         r"at most 64"):
        check_lora(dense, LoRAConfig(rank=512, target_modules=["q_proj", "k_proj", "v_proj"]))
    with pytest.raises(ValueError, match="LoRA on a mixture of experts"):
        check_lora(ModelSpec.from_hf_config(QWEN3_MOE), LoRAConfig(rank=4))
    check_lora(dense, LoRAConfig(rank=4, target_modules=["o_proj", "down_proj"]))


HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_lora_initialisation_is_the_same_whole_adapter_at_any_tp_size():
    """A starts from the layer's seed as one whole tensor, then is cut: every TP rank holds the same replicated
    A (a column linear's) and its own columns of a row linear's, so checkpoints and merges agree across ranks;
    its bound is Kaiming's over the whole input (PEFT's), and B starts at zero."""
    from workers.megatron.lora import LoRAAdapter

    for linear, parts, cut_dim in (("mlp.linear_fc1", {"gate": (32, 48), "up": (32, 48)}, None),
                                   ("self_attention.linear_proj", {"o": (64, 32)}, 1)):
        whole = LoRAAdapter(linear, parts, 4, 2.0, 0.0, None, seed=11, row_parallel=cut_dim == 1)
        ranks = [LoRAAdapter(linear, parts, 4, 2.0, 0.0, None, tp=2, tp_rank=r, seed=11, row_parallel=cut_dim == 1)
                 for r in (0, 1)]
        for part, (fan_in, fan_out) in parts.items():
            a = whole.lora_A[part]
            assert a.shape == (4, fan_in) and 0.9 / fan_in ** 0.5 < a.abs().max() <= 1 / fan_in ** 0.5
            pieces = [r.lora_A[part] for r in ranks]
            if cut_dim is None:  # replicated over TP
                assert all(torch.equal(p, a) for p in pieces)
                assert [tuple(r.lora_B[part].shape) for r in ranks] == [(fan_out // 2, 4)] * 2
            else:
                assert torch.equal(torch.cat(pieces, cut_dim), a)
            assert not any(r.lora_B[part].any() for r in ranks)
        other = LoRAAdapter(linear, parts, 4, 2.0, 0.0, None, seed=12)
        assert not torch.equal(other.lora_A[next(iter(parts))], whole.lora_A[next(iter(parts))])


def test_lora_dropout_draws_a_mask_per_part_and_only_in_the_update():
    """PEFT's q_proj, k_proj and v_proj (gate_proj, up_proj) are separate modules, each with its own dropout: the
    fused linear's parts must not share one mask. Statistically: with p = 0.5, two independent masks drop the
    same element a quarter of the time (one shared mask: half). And outside the update (no gradients: old
    log-probs, reference, values, validation; or eval mode) nothing is dropped."""
    from workers.megatron.lora import LoRAAdapter

    torch.manual_seed(0)
    adapter = LoRAAdapter("self_attention.linear_qkv", {"q": (64, 64), "k": (64, 32), "v": (64, 32)}, 4, 2.0, 0.5,
                          None, groups=2)
    x = torch.ones(64, 64)
    inputs = adapter.dropped_inputs(x)
    dropped = {part: (t == 0) for part, t in inputs.items()}
    for part, mask in dropped.items():  # each drops about half, and scales the rest by 1 / (1 - p)
        assert 0.45 < mask.float().mean() < 0.55, part
        assert torch.equal(inputs[part][~mask], torch.full((int((~mask).sum()),), 2.0))
    for a, b in (("q", "k"), ("q", "v"), ("k", "v")):  # 4096 elements: the standard error is 0.007
        both = (dropped[a] & dropped[b]).float().mean()
        assert abs(both - 0.25) < 0.05, (a, b, both)
    with torch.no_grad():  # the passes without gradients
        assert all(torch.equal(t, x) for t in adapter.dropped_inputs(x).values())
    adapter.eval()
    assert all(torch.equal(t, x) for t in adapter.dropped_inputs(x).values())
