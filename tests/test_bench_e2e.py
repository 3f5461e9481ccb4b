"""tools/bench_e2e.py's pure parts: FLOPs and MFU, the per-step figures and table, and both jobs' inputs agreeing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools import bench_e2e as e2e  # noqa: E402
from tools import bench_e2e_trl as trl_side  # noqa: E402

SMALL = e2e.ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)


def test_update_flops_match_a_hand_count():
    # One block: q 8x8 = 64, k and v 8x4 = 32 each, o 64, gate/up/down 3 x 8x16 = 384: 576; two blocks 1152.
    assert SMALL.layer_matmul_params == 576 and SMALL.body_matmul_params == 1152 and SMALL.output_params == 80
    # 2 sequences, 6 prompt + 4 response tokens (mean length 5):
    #   6 x 1152 x 10 = 69120, output layer 6 x 80 x 4 = 1920, attention 6 x 2 layers x 8 x 2 seqs x 5^2 = 4800
    assert e2e.update_flops(SMALL, 2, 6, 4) == 69120 + 1920 + 4800
    with pytest.raises(ValueError, match="sequences"):
        e2e.update_flops(SMALL, 0, 6, 4)


def test_model_shape_from_an_hf_config():
    smollm2 = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
               "intermediate_size": 1536, "vocab_size": 49152}
    shape = e2e.ModelShape.from_hf_config(smollm2)
    assert shape.head_dim == 64
    # q 576x576 + k, v 576x192 each + o 576x576 + 3 x 576x1536
    assert shape.layer_matmul_params == 331776 + 2 * 110592 + 331776 + 3 * 884736
    assert shape.output_params == 576 * 49152
    no_kv = e2e.ModelShape.from_hf_config({**smollm2, "num_key_value_heads": None, "head_dim": 32})
    assert no_kv.kv_heads == 9 and no_kv.head_dim == 32


def test_mfu():
    assert e2e.mfu(1e12, 2.0, 1e12) == 0.5
    with pytest.raises(ValueError, match="seconds"):
        e2e.mfu(1.0, 0.0, 1.0)


def _record(step: int, step_s: float, update: float, reward: float) -> dict:
    return {"step": step, "critic/score/mean": reward, "prompt_length/mean": 3.0, "response_length/mean": 2.0,
            "timing_s/gen": 1.0, "timing_s/reshard": 0.1, "timing_s/weight_sync": 0.2, "timing_s/rollout": 1.5,
            "timing_s/reward": 0.01, "timing_s/old_log_prob": 0.5, "timing_s/adv": 0.01,
            "timing_s/update_actor": update, "timing_s/step": step_s}


def test_hybridflow_steps_and_summary_skip_the_warmup():
    records = [{"step": 0, "val/reward/mean": 0.5}] + [_record(k, 10.0 if k == 1 else 4.0, 2.0, 0.1 * k)
                                                        for k in range(1, 8)]
    steps = e2e.hybridflow_steps(records, sequences=2)
    assert [s["step"] for s in steps] == list(range(1, 8))  # validation (step 0) is not a step
    phases = steps[1]["phases"]
    assert phases["rollout_other"] == pytest.approx(0.2) and phases["other"] == pytest.approx(4.0 - 1.5 - 2.52)
    assert steps[1]["prompt_tokens"] == 6 and steps[1]["response_tokens"] == 4  # means x sequences

    summary = e2e.summarize(steps, warmup=1, shape=SMALL, peak_flops_per_s=75840 / 2.0 * 4, sequences=32)
    assert summary["timed_steps"] == 6 and summary["s_per_step"] == 4.0  # the 10 s first step left out
    assert summary["completions_per_s"] == 8.0
    assert summary["reward_first5"] == pytest.approx(0.3) and summary["reward_last5"] == pytest.approx(0.5)
    assert summary["update_flops"] == 75840 and summary["mfu_update"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="warm-up"):
        e2e.summarize(steps[:1], warmup=1, shape=SMALL, peak_flops_per_s=1.0, sequences=32)


def test_speedups_and_table():
    def row(framework, precision, s_per_step, status="ok"):
        return {"id": f"{framework}-{precision}", "framework": framework, "model": "tiny", "precision": precision,
                "response_length": 16, "steps": 4, "status": status, "s_per_step": s_per_step,
                "completions_per_s": 32 / s_per_step if s_per_step else None, "reward_first5": 0.1,
                "reward_last5": 0.4, "mfu_update": 0.123, "phases_s": {"gen": 1.0, "update_actor": 2.0},
                "error": None if status == "ok" else "RowFailed: no precision setting\nmore"}

    rows = [row("trl", "fp32", 8.0), row("hybridflow", "fp32", 2.0), row("hybridflow", "bf16", None, "failed"),
            row("trl", "bf16", 4.0)]
    e2e.add_speedups(rows)
    assert [r["speedup_vs_trl"] for r in rows] == [1.0, 4.0, None, 1.0]
    table = e2e.format_table(rows)
    assert "4.00x" in table and "12.3%" in table and "0.10 -> 0.40" in table
    assert "FAILED: RowFailed: no precision setting" in table and "more" not in table
    assert "update" in table.splitlines()[-5]  # the phase table's header


def _both(tmp_path: Path, precision: str = "fp32", bf16_mode: str = "autocast"):
    settings = e2e.GRPOSettings(steps=5, max_new_tokens=16)
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    # Without actor.engine.precision in this checkout's EngineConfig the YAML leaves the key out (fp32 only).
    precision_key = precision != "fp32" or e2e.hybridflow_has_precision()
    yaml_cfg = e2e.hybridflow_config(settings, str(tmp_path / "model"), str(train), str(tmp_path / "run"),
                                     precision, max_prompt_length=48, kv_bytes=256 << 20, precision_key=precision_key)
    spec = e2e.trl_spec(settings, str(tmp_path / "model"), str(train), str(tmp_path / "trl"), precision, bf16_mode,
                        threads=2, expected_prompt_ids=[[1, 2]])
    return settings, yaml_cfg, spec, trl_side.grpo_config_kwargs(spec)


def test_hybridflow_yaml_and_trl_spec_agree_on_every_shared_setting(tmp_path):
    s, cfg, spec, g = _both(tmp_path)
    actor, optim, ppo = cfg["actor"]["engine"], cfg["actor"]["optim"], cfg["ppo"]
    sampling = cfg["rollout"]["sampling"]
    pairs = {
        "model": (cfg["model_path"], spec["model_path"]),
        "data": (cfg["data"]["train_files"], [spec["train_file"]]),
        "steps": (cfg["trainer"]["total_steps"], g["max_steps"]),
        "samples per prompt": (sampling["n"], g["num_generations"]),
        "sequences per update": (cfg["data"]["batch_size"] * sampling["n"],
                                 g["per_device_train_batch_size"] * g["gradient_accumulation_steps"]),
        "one optimizer step": (ppo["ppo_mini_batch_size"],
                               g["per_device_train_batch_size"] * g["gradient_accumulation_steps"]),
        "micro-batch": (actor["micro_batch_size"], g["per_device_train_batch_size"]),
        "max new tokens": (sampling["max_new_tokens"], g["max_completion_length"]),
        "temperature": (sampling["temperature"], g["temperature"]),
        "top_p": (sampling["top_p"], g["top_p"]),
        "all tokens (top_k)": (sampling["top_k"] == -1, g["top_k"] == 0),
        "lr": (optim["lr"], g["learning_rate"]),
        "constant lr": ((optim["lr_decay_style"], optim["lr_warmup_steps"]),
                        (g["lr_scheduler_type"], g["warmup_steps"])),
        "weight decay": (optim["weight_decay"], g["weight_decay"]),
        "adam": ((optim["adam_beta1"], optim["adam_beta2"], optim["adam_eps"]),
                 (g["adam_beta1"], g["adam_beta2"], g["adam_epsilon"])),
        "grad clip": (optim["clip_grad"], g["max_grad_norm"]),
        "ppo epochs": (ppo["ppo_epochs"], g["num_iterations"]),
        "clip low": (ppo["clip_ratio_low"], g["epsilon"]),
        "clip high": (ppo["clip_ratio_high"], g["epsilon_high"]),
        "no dual clip / delta": (ppo["clip_ratio_c"], g.get("delta")),
        "no KL": ((ppo["use_kl_loss"], cfg["algorithm"]["kl_in_reward"]), (g["beta"] != 0, False)),
        "entropy": (ppo["entropy_coeff"], g["entropy_coef"]),
        "token-mean loss": (ppo["loss_agg_mode"] == "token-mean", g["loss_type"] == "dapo"),
        "group std scaling": (cfg["algorithm"]["norm_adv_by_std"], g["scale_rewards"] == "group"),
        "row order": (cfg["data"]["shuffle"], g["shuffle_dataset"]),
        "seed": (cfg["trainer"]["seed"], g["seed"]),
        "no recompute": (actor.get("recompute_granularity"), None if not g["gradient_checkpointing"] else "full"),
        "fp32": ((actor.get("precision", "fp32"), False), (spec["precision"], g["bf16"])),
    }
    for name, (hybridflow_value, trl_value) in pairs.items():
        assert hybridflow_value == trl_value, f"{name}: hybridflow {hybridflow_value!r} vs TRL {trl_value!r}"
    assert cfg["reward"]["fn"] == spec["reward_fn"] == "arithmetic_answer"
    assert Path(spec["reward_file"]) == ROOT / "workers" / "reward" / "text_rules.py"
    assert spec["settings"]["steps"] == s.steps and cfg["algorithm"]["name"] == "grpo"


def test_the_hybridflow_yaml_is_a_valid_config(tmp_path):
    from controller.config import check_config, config_from_dict

    _, cfg, _, _ = _both(tmp_path)
    config = config_from_dict(cfg)
    check_config(config)  # mini-batches divide, data file exists, the reward function resolves
    assert config.trainer.launcher == "torchrun" and config.trainer.nproc == 1
    assert config.rollout.sampling.max_new_tokens == 16 and config.ppo.clip_ratio_c is None


def test_the_token_budget_reaches_hybridflow_and_leaves_trl_as_it_is(tmp_path):
    from controller.config import check_config, config_from_dict

    _, fixed, _, g_fixed = _both(tmp_path)
    assert "max_tokens_per_micro_batch" not in fixed["actor"]["engine"]
    s = e2e.GRPOSettings(steps=5, max_new_tokens=16, token_budget=512)
    train = tmp_path / "train.parquet"
    cfg = e2e.hybridflow_config(s, str(tmp_path / "model"), str(train), str(tmp_path / "run"), "fp32", 48, 256 << 20)
    assert cfg["actor"]["engine"]["max_tokens_per_micro_batch"] == 512
    config = config_from_dict(cfg)
    check_config(config)  # 512 >= the longest sequence, 48 + 16
    assert config.actor.engine.max_tokens_per_micro_batch == 512
    spec = e2e.trl_spec(s, str(tmp_path / "model"), str(train), str(tmp_path / "trl"), "fp32", "autocast", 2, [[1]])
    assert trl_side.grpo_config_kwargs(spec)["per_device_train_batch_size"] == g_fixed["per_device_train_batch_size"]


def test_precisions(tmp_path):
    _, cfg, spec, g = _both(tmp_path, "bf16", "autocast")
    assert cfg["actor"]["engine"]["precision"] == "bf16" and g["bf16"] and g["model_init_kwargs"]["dtype"] == "float32"
    g = trl_side.grpo_config_kwargs({**spec, "bf16_mode": "weights"})
    assert g["bf16"] and g["model_init_kwargs"]["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="bf16_mode 'half'"):
        trl_side.grpo_config_kwargs({**spec, "bf16_mode": "half"})
    settings = e2e.GRPOSettings(steps=2, max_new_tokens=16)
    with pytest.raises(ValueError, match="actor.engine.precision"):
        e2e.hybridflow_config(settings, "m", "t", "r", "bf16", 48, 1 << 28, precision_key=False)
    no_key = e2e.hybridflow_config(settings, "m", "t", "r", "fp32", 48, 1 << 28, precision_key=False)
    assert "precision" not in no_key["actor"]["engine"]
    with pytest.raises(ValueError, match="'fp16' is not one of"):
        e2e.hybridflow_config(settings, "m", "t", "r", "fp16", 48, 1 << 28)


def test_reward_adapter_calls_the_projects_function():
    fn = trl_side.load_reward_fn(e2e.REWARD_FILE, "arithmetic_answer")
    scores: list[float] = []
    reward = trl_side.reward_adapter(fn, scores)
    prompts = [[{"role": "user", "content": "What is 3 + 4? Answer with just the number."}]] * 2
    completions = [[{"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "The answer is 8"}]]
    truths = [{"style": "rule", "ground_truth": "7"}] * 2
    assert reward(prompts, completions, reward_model=truths, data_source=["arithmetic"] * 2) == [1.0, 0.0]
    assert scores == [0.5] and reward.__name__ == "arithmetic_answer"
    with pytest.raises(AttributeError, match="no reward function 'nope'"):
        trl_side.load_reward_fn(e2e.REWARD_FILE, "nope")


def test_the_reward_file_loads_by_path_in_a_bare_interpreter_as_the_trl_job_loads_it(tmp_path):
    """TRL's venv has neither the project nor its dependencies: the file the TRL job loads by path must need only
    the standard library. ``-I -S``: no site-packages, no PYTHONPATH, no project on the path; run from elsewhere.
    (It broke once, silently, when functions.py, the file it loaded then, began importing the project.)"""
    import subprocess
    import sys

    program = ("import importlib.util, sys\n"
               "spec = importlib.util.spec_from_file_location('hybridflow_reward_functions', sys.argv[1])\n"
               "module = importlib.util.module_from_spec(spec)\n"
               "spec.loader.exec_module(module)\n"
               "print(sorted(set(sys.modules) & {'workers', 'controller', 'hybridengine', 'torch', 'numpy'}))\n"
               "print(getattr(module, sys.argv[2])('', 'The answer is #### 1,000', '1000', {}))")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", program, str(e2e.REWARD_FILE), e2e.REWARD_FN],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "1.0"]


def test_flags():
    assert e2e.steps_per_length("16:30,256:4", [16, 256]) == {16: 30, 256: 4}
    assert e2e.steps_per_length("3", [16, 256]) == {16: 3, 256: 3}
    assert e2e.steps_per_length("16:5", [16, 128]) == {16: 5, 128: 4}
    with pytest.raises(ValueError, match="LEN:STEPS"):
        e2e.steps_per_length("16-5", [16])
    assert e2e.parse_list("trl,hybridflow,trl", e2e.FRAMEWORKS, "frameworks") == ["trl", "hybridflow"]
    with pytest.raises(ValueError, match="'vllm' is not one of hybridflow, trl"):
        e2e.parse_list("vllm", e2e.FRAMEWORKS, "frameworks")
    with pytest.raises(ValueError, match="positive"):
        e2e.parse_list("16,0", (), "response-lengths", int)


def test_kv_cache_fits_a_step():
    shape = e2e.ModelShape.from_hf_config({"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                                           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152})
    assert e2e.kv_cache_bytes(shape, "fp32", 60, 32) == 256 << 20  # the floor
    need = 2 * 30 * 3 * 64 * 4 * 320 * 32
    assert e2e.kv_cache_bytes(shape, "fp32", 320, 32) >= 2 * need
    assert e2e.kv_cache_bytes(shape, "bf16", 320, 32) < e2e.kv_cache_bytes(shape, "fp32", 320, 32)


def test_a_failed_jobs_own_error_line_is_found(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("[rank0]: Traceback (most recent call last):\n"
                   "[rank0]: AttributeError: 'EngineConfig' object has no attribute 'x'\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                   "controller.cli FAILED\n")
    assert e2e._last_error(log) == "AttributeError: 'EngineConfig' object has no attribute 'x'"
    assert e2e._last_error(tmp_path / "missing.log") == "no log"
