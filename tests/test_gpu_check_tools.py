"""tools/bench_gpu_train.py's arithmetic: FLOPs per token, MFU, the GRPO run summary, the check's summary."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench_gpu_train import (
    SHAPES, build_summary, format_summary, matmul_flops, summarize_metrics,
)
from tools.bench_e2e import ModelShape


def test_smollm2_shape_is_135m():
    from transformers import LlamaConfig

    config = LlamaConfig(**SHAPES["smollm2"])
    hidden, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    kv = config.num_key_value_heads * hidden // config.num_attention_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    params = layers * per_layer + config.vocab_size * hidden + hidden  # tied: the embedding once
    assert params == 134_515_008  # SmolLM2-135M-Instruct's count (ENVIRONMENT.md: 134.5M)


@pytest.mark.parametrize("shape", ["tiny", "smollm2"])
def test_the_flop_count_covers_every_weight_matmul(shape):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    if shape == "smollm2":  # the same count on a 2-layer model of its widths (a 135M model is slow to build)
        s = {**s, "num_hidden_layers": 2}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**s))
    # Every nn.Linear's weight is one multiply-accumulate per token: the layers' and the output layer.
    macs = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    dims = ModelShape.from_hf_config(s)
    assert dims.body_matmul_params + dims.output_params == macs


def test_matmul_flops():
    assert matmul_flops(8192) == 2 * 8192**3


def _step(step, score, seconds, gen, memory=1.0):
    return {"step": step, "critic/score/mean": score, "timing_s/step": seconds, "timing_s/gen": gen,
            "rollout/logprob_diff_max": 1e-3 * step, "perf/max_memory_gb": memory, "perf/throughput": 100.0 * step}


def test_summarize_metrics_medians_after_the_first_step():
    rows = [{"step": 0, "val/reward/mean": 0.1}, _step(1, 0.1, 9.0, 5.0), _step(2, 0.2, 1.0, 0.4, 2.0),
            _step(3, 0.5, 3.0, 0.6), _step(4, 0.4, 2.0, float("nan"))]
    s = summarize_metrics(rows)
    assert s["steps"] == 4 and s["first_step_s"] == 9.0
    assert s["s_per_step"] == 2.0  # steps 2..4; the warm-up step apart
    assert s["phases_s"] == {"gen": 0.5}  # a non-finite value is left out
    assert (s["reward_first"], s["reward_last"]) == (0.1, 0.4)
    assert s["logprob_diff_max"] == pytest.approx(4e-3) and s["max_memory_gb"] == 2.0
    assert summarize_metrics([_step(1, 0.3, 4.0, 1.0)])["s_per_step"] == 4.0  # one step: that step
    with pytest.raises(ValueError, match="no training step"):
        summarize_metrics([{"step": 0, "val/reward/mean": 0.1}])


def test_build_summary_and_its_block():
    kernels = [{"op": "gae", "case": "a", "speedup": 4.0}, {"op": "log_prob", "case": "b", "speedup": 0.25},
               {"op": "reshard", "case": "c", "speedup": 1.0}]
    grpo = summarize_metrics([_step(1, 0.1, 9.0, 5.0), _step(2, 0.2, 1.0, 0.4)])
    summary = build_summary([("build", "ok", 60.0), ("ops", "skipped", 0.0), ("grpo", "ok", 30.5)],
                            {"kernels": kernels, "grpo": grpo})
    assert summary["ok"]
    assert summary["kernels"] == {"cases": 3, "speedup_geomean": 1.0, "slowest": "log_prob b: 0.25x"}
    text = format_summary(summary)
    assert "grpo: 2 steps, 1.0 s/step (first 9.0 s); reward 0.1000 -> 0.2000" in text
    assert text.rstrip().endswith("overall: ok")
    failed = build_summary([("train", "timeout", 150.0), ("grpo", "no-time", 0.0)], {})
    assert not failed["ok"] and "overall: FAILED" in format_summary(failed)


def test_summary_command_reads_sections_and_exits_nonzero_on_a_failure(tmp_path):
    results = tmp_path / "sections"
    results.mkdir()
    (tmp_path / "sections.tsv").write_text("install\tok\t3.5\ntrain\tfailed\t20.0\n")
    (results / "grpo.json").write_text(json.dumps(summarize_metrics([_step(1, 0.1, 2.0, 1.0)])))
    script = Path(__file__).resolve().parent.parent / "tools" / "bench_gpu_train.py"
    proc = subprocess.run([sys.executable, str(script), "summary", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "train      failed" in proc.stdout and "grpo: 1 steps" in proc.stdout
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["sections"]["train"] == {"status": "failed", "seconds": 20.0} and not written["ok"]
    assert math.isclose(written["grpo"]["s_per_step"], 2.0)


def test_the_moe_section_reaches_the_summary():
    from tools.bench_gpu_train import build_summary, format_summary

    figures = {"max_abs_log_prob_difference": 2e-6, "update_tokens_per_s": 900.0, "moe/load_max_over_mean": 1.75}
    generation = {"ok": True, "greedy_equals_hf": True, "seconds": 0.5, "expert_bytes_received": 0}
    summary = build_summary([("moe", "ok", 20.0)], {"moe": {"device": "cuda:0", "fp32": figures, "bf16": figures,
                                                            "generation": generation}})
    assert summary["ok"] and summary["moe"]["fp32"] == figures
    text = format_summary(summary)
    assert ("moe (tiny Qwen3-MoE actor vs transformers, cuda:0): fp32 log-prob max diff 2.0e-06, update 900 tok/s, "
            "expert load max/mean 1.75; bf16") in text
    assert "megatron rollout after the reshard over experts: greedy equals HF's (0.5 s)" in text


def test_the_vision_section_reaches_the_summary():
    from tools.bench_gpu_train import build_summary, format_summary

    figures = {"max_abs_log_prob_difference": 3.9e-3, "grad_norm": 3.42, "hf_grad_norm": 3.42,
               "grad_norm_relative_difference": 7e-5, "ok": True}
    summary = build_summary([("vision", "ok", 30.0)], {"vision": {"device": "cuda:0", "fp32": figures,
                                                                  "bf16": figures}})
    assert summary["ok"] and summary["vision"]["bf16"] == figures
    assert ("vision (tiny Qwen2.5-VL actor, tower trained, vs transformers, cuda:0): fp32 log-prob max diff 3.9e-03, "
            "grad norm 7.0e-05 relative; bf16") in format_summary(summary)


def test_the_context_section_reaches_the_summary():
    from tools.bench_gpu_train import build_summary, format_summary

    figures = {"max_abs_log_prob_difference": 2.1e-6, "grad_norm": 3.0, "grad_norm_relative_difference": 4e-7}
    run = {"device": "cuda:0", "rows": 16, "longest": 1024, "fp32": {"padded": figures, "packed": figures, "ok": True},
           "bf16": {"padded": figures, "packed": figures, "ok": True}}
    summary = build_summary([("context", "ok", 40.0)], {"context": {"cp1": run}})
    assert summary["ok"] and summary["context"]["cp1"]["fp32"]["packed"] == figures
    assert ("context cp1 (tiny Llama actor on 16 rows of up to 1024 tokens vs transformers, cuda:0): fp32 padded "
            "log-prob max diff 2.1e-06, grad norm 4.0e-07 relative; fp32 packed") in format_summary(summary)


def test_the_distill_section_reaches_the_summary():
    from tools.bench_gpu_train import build_summary, format_summary

    rows = [{"step": 0, "val/reward/mean": 0.0}]
    for step, kl in ((1, 4.0), (2, 2.5), (3, 1.0)):
        rows.append({**_step(step, 0.0, 1.0, 0.2), "actor/opd/reverse_kl": kl, "timing_s/teacher": 0.1})
    rows[-1]["val/reward/mean"] = 0.25
    distill = summarize_metrics(rows)
    assert (distill["reverse_kl_first"], distill["reverse_kl_last"]) == (4.0, 1.0)
    assert (distill["val_first"], distill["val_last"]) == (0.0, 0.25) and distill["phases_s"]["teacher"] == 0.1
    assert "reverse_kl_first" not in summarize_metrics(rows[:1] + [_step(1, 0.1, 1.0, 0.2)])  # no teacher: none
    text = format_summary(build_summary([("distill", "ok", 50.0)], {"distill": distill}))
    assert ("distill (OPD, the SFT export teaching a fresh tiny model): 3 steps, 1.0 s/step, teacher 0.1 s; reverse "
            "KL 4.000 -> 1.000; greedy accuracy 0.000 -> 0.250") in text
