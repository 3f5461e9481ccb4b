"""vLLM and megatron rollout colocated with a megatron actor, in real torchrun processes on CPU.

After each weight sync greedy output equals HF transformers' on the same
weights (before and after a PPO update), sampled log-probs agree with the
actor's compute_log_prob, seeds reproduce samples, and bad requests fail
before generation without breaking the group.
"""

from pathlib import Path

import torch
from conftest import run_torchrun
from rollout_checks import assert_greedy_matches_hf, hf_log_probs, responses
from tiny_models import make_llama, make_qwen3_moe

from controller.models.char_tokenizer import save_char_tokenizer

PROGRAM = Path(__file__).parent / "rollout_program.py"
MAX_NEW = 10


def run_program(tmp_path, nproc, engine, tp, gen_tp, kv_heads=2, pp=1, gen_pp=1, tie=False, moe=None, micro_batch=4,
                bucket_bytes=256 << 20):
    """``moe``: (training EP, training ETP, generation with whole experts) for a tiny Qwen3-MoE instead of the
    tiny Llama; ``bucket_bytes``: the rollout's ``weight_bucket_bytes`` (vLLM loads each sync in such buckets)."""
    if moe is None:
        model, extra = make_llama(tmp_path / "model", kv_heads=kv_heads, tie=tie), []
    else:
        model = make_qwen3_moe(tmp_path / "model", kv_heads=kv_heads, head_dim=32)  # a head size vLLM's CPU attention runs
        extra = ["--ep", str(moe[0]), "--etp", str(moe[1]), *(["--expert-parallel"] if moe[2] else []),
                 "--return-routed-experts"]
    model = save_char_tokenizer(model, 256)
    out = tmp_path / "out"
    out.mkdir()
    proc = run_torchrun(PROGRAM, [str(model), str(out), "--engine", engine, "--tp", str(tp), "--pp", str(pp),
                                  "--gen-tp", str(gen_tp), "--gen-pp", str(gen_pp), "--micro-batch", str(micro_batch),
                                  "--weight-bucket-bytes", str(bucket_bytes), *extra], nproc=nproc, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return model, out, torch.load(out / "rollout.pt", weights_only=False)


def check_rollout(model, out, result):
    # Greedy equals HF greedy on the same weights, before and after the actor's update.
    assert_greedy_matches_hf(result["greedy"], model, MAX_NEW)
    assert_greedy_matches_hf(result["greedy_after"], out / "updated", MAX_NEW)
    assert responses(result["greedy"]) != responses(result["greedy_after"])  # the update changed the policy
    # Sampled: n=2 per prompt, prompt-major, reproducible by seed.
    sampled = result["sampled"]
    assert len(sampled) == 12 and sampled.non_tensor_batch["row"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert torch.equal(sampled.batch["responses"], result["sampled_again"].batch["responses"])
    assert not torch.equal(sampled.batch["responses"], result["other_seed"].batch["responses"])
    assert responses(sampled)[0] != responses(sampled)[1]  # two samples of one prompt differ
    # Rollout log-probs (tempered) agree with the actor's recomputation and with HF.
    mask = sampled.batch["response_mask"].bool()
    assert sampled.meta_info["temperature"] == 0.7
    diff = (sampled.batch["rollout_log_probs"] - result["recomputed"].batch["old_log_probs"])[mask].abs()
    assert diff.max() < 1e-4, diff.max()
    hf = hf_log_probs(sampled, model, 0.7)
    assert (hf - sampled.batch["rollout_log_probs"])[mask].abs().max() < 1e-4
    # Layout of the batch: prompt left-padded, response right-padded, positions continue over the response.
    b = result["greedy"].batch
    assert b["input_ids"].shape == (6, 8 + MAX_NEW) and b["responses"].shape == (6, MAX_NEW)
    assert torch.equal(b["position_ids"][0], (b["attention_mask"][0].cumsum(0) - 1).clamp(min=0))
    metrics = result["greedy"].meta_info["metrics"]
    for key in ("timing_s/reshard", "timing_s/weight_sync", "timing_s/gen", "weight_sync/bytes", "reshard/bytes_received"):
        assert key in metrics, sorted(metrics)


def assert_routes_match_hf(batch, model_dir):
    """Every row's rollout_routed_experts: HF's routers' top-k (ascending) on each real position but the last;
    -1 on the last token and the padding."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    routes, mask = batch.batch["rollout_routed_experts"], batch.batch["attention_mask"].bool()
    for row in range(len(batch)):
        ids = batch.batch["input_ids"][row][mask[row]]
        with torch.no_grad():
            logits = hf(ids.unsqueeze(0), output_router_logits=True).router_logits
        want = torch.stack([layer.topk(routes.shape[-1], -1).indices.sort(-1).values for layer in logits], 1)
        got = routes[row][mask[row]]
        assert torch.equal(got[:-1].long(), want[:-1]), row
        assert (got[-1] == -1).all() and (routes[row][~mask[row]] == -1).all()


def check_bad_inputs(errors):
    assert "prompt 3 has 10 tokens, more than max_prompt_length=8" in errors["too_long"]
    assert "max_new_tokens must be a positive integer, got 0" in errors["max_new_tokens"]
    assert "cannot split an empty DataProto" in errors["empty"]
    assert len(errors["after"]) == 6  # the group still generates


def test_vllm_rollout_from_tp2_actor(tmp_path):
    """Training TP2 on 2 ranks -> vLLM at generation TP2 (one engine over both ranks).

    The megatron generator at generation TP1 and TP2 from a TP2 layout is in test_megatron_rollout.py, the
    megatron Rollout role resharding a TP2 x PP2 actor below; vLLM micro-DP replicas (TP1) run in the PPO
    run of test_train_cli.py (TP2 x PP2 -> four vLLM engines, rollout and actor log-probs agreeing).
    """
    # A model with tied embeddings: vLLM's lm_head shares the embedding the sync reloads. The syncs load in
    # 256 KiB buckets (rollout.weight_bucket_bytes): one reload of the model, filled a bucket at a time.
    model, out, result = run_program(tmp_path, 2, "vllm", tp=2, gen_tp=2, tie=True, bucket_bytes=256 << 10)
    check_rollout(model, out, result)
    check_bad_inputs(result["errors"])
    # The KV cache vLLM made of rollout.kv_cache_bytes, against the planner's model of it: whole blocks of
    # 2 x layers x KV heads per rank x head_dim per token (vLLM's CPU blocks are 128 tokens).
    from controller.planner.memory import kv_bytes_per_token
    from hybridengine.model.spec import ModelSpec
    from workers.rollout.config import RolloutConfig

    block = 128 * kv_bytes_per_token(ModelSpec.from_pretrained(model), 2, "fp32")
    predicted = RolloutConfig().kv_cache_bytes // block * 128
    assert result["greedy"].meta_info["metrics"]["rollout/kv_cache_tokens"] == predicted


def test_vllm_rollout_of_a_mixture_of_experts_on_strided_generation_groups(tmp_path):
    """A Qwen3-MoE actor at TP4 (EP2 x ETP2, sequence-parallel) -> vLLM at generation TP2: the engines run on
    the hybrid engine's strided groups [0, 2] and [1, 3]; attention and the router go through the micro-DP
    gather, the routed experts point to point, each expert cut across the two generation ranks, and vLLM loads
    them into its fused-experts tensors (on CPU padded and repacked, which a weight update must redo:
    vllm_compat's fused_moe_reload). Greedy equals HF before and after an update; sampled log-probs agree with
    the actor's and HF's. The experts vLLM's routers chose for every prompt and response position (vLLM's
    capturer on its V1 runner) are HF's routers' top-k on the same tokens, and the actor's routers, compared
    with them in its log-prob pass, agree on every one. (vLLM's expert parallelism is not run here: its CPU
    fused-experts kernel crashes under it, with vLLM's own checkpoint loading too.)"""
    model, out, result = run_program(tmp_path, 4, "vllm", tp=4, gen_tp=2, kv_heads=4, moe=(2, 2, False),
                                     bucket_bytes=512 << 10)  # the experts a layer at a time, in 512 KiB buckets
    check_rollout(model, out, result)
    for key in ("greedy", "sampled", "greedy_after"):
        assert_routes_match_hf(result[key], model if key != "greedy_after" else out / "updated")
    assert result["recomputed"].meta_info["router_replay"]["router_replay/agreement"] == 1.0
    from hybridengine.model.spec import ModelSpec
    from hybridengine.parallel.layout import ParallelLayout
    from hybridengine.reshard.plan import GenerationLayout
    from hybridengine.reshard.weight_plan import plan_weights

    plan = plan_weights(ModelSpec.from_pretrained(model), ParallelLayout(4, 1, 1, 2, 2), GenerationLayout(2))
    assert plan.layout.gen_tp_groups == ((0, 2), (1, 3))
    # Ranks 0 and 3 hold the right FFN half of four experts a layer and lack the other four; ranks 1 and 2 hold
    # the wrong half and lack all eight: 2 layers x experts x 16 units x (gate, up, down of 64) x fp32.
    unit = 2 * 16 * 3 * 64 * 4
    assert [plan.experts.bound(r, 4) for r in range(4)] == [4 * unit, 8 * unit, 8 * unit, 4 * unit]
    assert result["greedy"].meta_info["metrics"]["reshard/expert_bytes_received"] in (4 * unit, 8 * unit)


def test_megatron_rollout_over_a_pipeline(tmp_path):
    """Training TP2 x PP2 on 4 ranks -> generation PP2 at TP1 (two replicas), megatron's engine over PP stages."""
    model, out, result = run_program(tmp_path, 4, "megatron", tp=2, pp=2, gen_tp=1, gen_pp=2)
    check_rollout(model, out, result)
    assert result["greedy"].meta_info["metrics"]["weight_sync/bytes"] == 0  # views into the buffer


def test_standalone_vllm_rollout_stops_and_refuses_partial_shards(tmp_path):
    model = save_char_tokenizer(make_llama(tmp_path / "model"), 256)
    out = tmp_path / "out"
    out.mkdir()
    proc = run_torchrun(Path(__file__).parent / "standalone_program.py", [str(model), str(out)], nproc=1, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = torch.load(out / "standalone.pt", weights_only=False)
    greedy, eos = result["hf_greedy"], result["eos"]
    first_eos = greedy.index(eos)
    assert responses(result["greedy"]) == [greedy[: first_eos + 1]]  # EOS ends the response and is kept
    assert result["greedy"].non_tensor_batch["finish_reason"].tolist() == ["stop"]
    assert responses(result["no_eos"]) == [greedy]  # ignore_eos: all 10 tokens, as HF without an EOS
    assert result["no_eos"].non_tensor_batch["finish_reason"].tolist() == ["length"]
    stop_at = greedy.index(greedy[1])  # one character per token: the stop text first appears here
    assert responses(result["stopped"]) == [greedy[: stop_at + 1]]  # the stop string's token ends it
    assert responses(result["short"]) == [greedy[:4]] and result["short"].batch["responses"].shape[1] == 4
    # Partial rollouts: continued 4 tokens a call, both rows follow HF's greedy tokens; the row 4 ahead ends at
    # max_new_tokens on the second call (limit 2) and says so; log-probs match the one-call generation's.
    first, second = result["chunks"]
    assert [responses(first)[0], responses(first)[1]] == [greedy[:4], greedy[:8]]
    assert [responses(second)[0], responses(second)[1]] == [greedy[:8], greedy]
    assert first.batch["finished"].tolist() == [False, False] and second.batch["finished"].tolist() == [False, True]
    whole = result["no_eos"].batch["rollout_log_probs"][0]
    assert torch.allclose(second.batch["rollout_log_probs"][1, 4:], whole[4:], atol=1e-5)
    assert torch.allclose(second.batch["rollout_log_probs"][0, :8], whole[:8], atol=1e-5)
    assert second.batch["rollout_log_probs"][1, :4].abs().sum() == 0  # given as zeros: come back as given
    # A stop string whose first token ends one call and whose second starts the next ends the response there,
    # as it does in one call.
    across = result["stop_across"]
    assert across is not None, f"no pair of greedy tokens {greedy} first appears across a 4-token boundary"
    keep = across["boundary"] + 1
    assert responses(across["whole"]) == [greedy[:keep]]
    assert [responses(c)[0] for c in across["chunks"]] == [greedy[:4 * i] for i in range(1, (keep - 1) // 4 + 1)] + [greedy[:keep]]
    assert across["chunks"][-1].non_tensor_batch["finish_reason"].tolist() == ["stop"]
    (refusal,) = result["missing_qkv"]
    assert "ShardLoadError" in refusal and "missing ['model.layers.0.self_attn.qkv_proj.weight'" in refusal


def test_vllm_routes_of_requests_preempted_under_kv_cache_pressure(tmp_path):
    """Routing replay's routes under KV-cache pressure: a KV cache of two of vLLM's 128-token CPU blocks for three
    160-token requests, so vLLM preempts requests and computes them again from their start. The routes filed
    for every position are the recomputation's, and equal those of an unpressured forward: HF's routers' top-k
    on the same tokens, each sequence computed whole. (The capture refused a preempted request before.)"""
    moe = make_qwen3_moe(tmp_path / "moe", head_dim=32, max_positions=256)  # a head size vLLM's CPU attention runs
    out = tmp_path / "out"
    out.mkdir()
    proc = run_torchrun(Path(__file__).parent / "standalone_program.py", [str(moe), str(out), "--moe"], nproc=1,
                        timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = torch.load(out / "pressured.pt", weights_only=False)
    assert result["pressured_recomputed"][0] > 0
    assert responses(result["pressured"]) and all(len(r) == 60 for r in responses(result["pressured"]))
    assert_routes_match_hf(result["pressured"], moe)
