"""`hybridflow sft` end to end on the built-in tiny model: the loss falls, validation is reported, a
stopped and resumed run equals the uninterrupted one (LoRA's, the adapters alone in its checkpoints), the HF
export starts an RL job (`model_path`), and bad input is refused before any process starts."""

import shutil

import pytest

from test_train_cli import TINY, hybridflow, model, read_metrics, third_party_lines  # noqa: F401  (model: a fixture)

SFT = ["trainer.nproc=2", "actor.engine.tensor_parallel=2", "actor.engine.pipeline_parallel=1",
       "actor.engine.micro_batch_size=4", "data.batch_size=8", "data.train_size=64", "data.val_size=16",
       "actor.optim.lr_warmup_steps=0", "actor.optim.lr_decay_steps=200", "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.total_steps=4",
       "trainer.save_every=2", "trainer.val_every=2"]


def exact(step):  # everything but wall-clock times and throughput
    return {k: v for k, v in step.items() if not k.startswith(("timing_s/", "perf/"))}


def test_sft_trains_and_its_export_starts_rl(tmp_path, model):  # noqa: F811
    """(A stopped SFT run resumes exactly: the LoRA job below stops and resumes through the same trainer state,
    and the full model's checkpoint resumes exactly in the RL demo's stop-and-resume test.)"""
    full = tmp_path / "full"
    proc = hybridflow("sft", "--config", "examples/sft_tiny.yaml", f"model_path={model}", f"trainer.run_dir={full}", *SFT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert "done: 4 SFT steps" in proc.stdout and "HF checkpoint" in proc.stdout
    assert proc.ending_s < 30, f"the job ended {proc.ending_s:.1f} s after its last line"  # every rank ends with its work
    steps = read_metrics(full)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert steps[-1]["sft/loss"] < steps[0]["sft/loss"] - 0.5, [s["sft/loss"] for s in steps]
    assert [("sft/val_loss" in s) for s in steps] == [False, True, False, True]
    assert steps[3]["sft/val_loss"] < steps[1]["sft/val_loss"]
    val_loss = (f"sft/val_loss {steps[1]['sft/val_loss']:.3f} at step 2 -> {steps[3]['sft/val_loss']:.3f} at step 4 "
                f"({steps[3]['sft/val_loss'] - steps[1]['sft/val_loss']:+.3f})")
    assert f"validation:     {val_loss} (token-mean cross-entropy, 16 examples)" in proc.stdout
    lrs = [s["sft/lr"] for s in steps]  # the example's cosine from 3e-3, over 200 steps, no warmup
    assert lrs == sorted(lrs, reverse=True) and 2.99e-3 < lrs[-1] < lrs[0] < 3e-3, lrs
    assert all(s["sft/grad_norm"] > 0 for s in steps)

    # The export is an HF checkpoint an RL job starts from.
    rl = tmp_path / "rl"
    proc = hybridflow("train", "--config", "examples/ppo_tiny.yaml", f"trainer.run_dir={rl}",
                      f"model_path={full / 'hf_actor'}", *TINY, "trainer.launcher=torchrun", "rollout.engine=megatron",
                      "ppo.ppo_mini_batch_size=4", "critic_ppo.ppo_mini_batch_size=4", "reward.fn=arithmetic_answer",
                      "trainer.val_before_train=true")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    rl_steps = read_metrics(rl)
    assert [s["step"] for s in rl_steps] == [0, 1]  # step 0: the SFT model's own greedy accuracy
    first, last = rl_steps[0]["val/reward/mean"], rl_steps[1]["val/reward/mean"]
    assert all(8 * v == round(8 * v) for v in (first, last))  # exact-answer accuracy on 8 prompts: a multiple of 1/8
    # The closing lines: the SFT run's validation loss, then the accuracy after SFT and after RL.
    assert proc.stdout.rstrip().splitlines()[-2:] == [
        f"[hybridflow]   SFT run:        {full}: {val_loss}",
        f"[hybridflow]   validation:     val/reward/mean {first:.3f} at step 0 (after SFT) -> {last:.3f} at step 1 "
        f"(after RL) ({last - first:+.3f}) (greedy; reward arithmetic_answer)"]


def test_bad_sft_input_is_refused_before_any_process_starts(tmp_path):
    proc = hybridflow("sft", "--config", "examples/sft_tiny.yaml", f"trainer.run_dir={tmp_path}",
                      "data.batch_size=7", "trainer.mode=async")
    assert proc.returncode == 2
    assert "data.batch_size gives each data-parallel rank 7 examples" in proc.stderr
    assert "trainer.mode is a setting of RL training" in proc.stderr
    proc = hybridflow("sft", "--config", "examples/sft_tiny.yaml", f"trainer.run_dir={tmp_path}", "trainer.nnodes=2")
    assert proc.returncode == 2
    assert "trainer.nnodes=2 with trainer.launcher=torchrun: set trainer.rdzv_endpoint=host:port" in proc.stderr
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"question": "1+1="}\n')
    proc = hybridflow("sft", "--config", "examples/sft_tiny.yaml", f"trainer.run_dir={tmp_path}", "data.task=files",
                      f"data.train_files=[{bad}]", "data.val_size=0", "trainer.val_every=0", "data.batch_size=8")
    assert proc.returncode == 2 and "row 0: no 'messages', 'prompt' + 'response' or 'text' column" in proc.stderr, proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_rl_from_an_sft_export_that_is_not_there_says_which_job_writes_it(tmp_path):
    missing = tmp_path / "sft" / "hf_actor"
    proc = hybridflow("train", "--config", "examples/ppo_from_sft.yaml", f"trainer.run_dir={tmp_path / 'rl'}",
                      f"model_path={missing}")
    assert proc.returncode == 2, proc.stderr
    assert f"model_path {missing} is not a directory" in proc.stderr and "run that job first" in proc.stderr, proc.stderr
    assert not (tmp_path / "rl" / "metrics.jsonl").exists()


def test_moe_examples_sft_then_grpo_with_expert_parallelism(tmp_path):
    """examples/moe_arithmetic_sft.yaml as written (the built-in Qwen3-MoE at EP2 on 4 processes, the
    load-balancing loss on), cut to 6 steps: the loss falls, the routing figures are logged every step and
    the export is a Qwen3-MoE that transformers loads, expert by expert. Then examples/moe_arithmetic.yaml
    from that export, cut to 2 steps: GRPO with vLLM generating from the resharded experts, each rank
    receiving exactly the experts it lacks, and the actor replaying the experts vLLM routed each token to
    (algorithm.router_replay: rollout)."""
    run = tmp_path / "moe"
    proc = hybridflow("sft", "--config", "examples/moe_arithmetic_sft.yaml", f"trainer.run_dir={run}",
                      "trainer.total_steps=6", "trainer.val_every=3", "trainer.save_every=6", "trainer.plots=false",
                      "trainer.logger=[jsonl]", "actor.optim.lr_warmup_steps=0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    steps = read_metrics(run)
    assert steps[-1]["sft/val_loss"] < steps[2]["sft/val_loss"] and steps[-1]["sft/loss"] < steps[0]["sft/loss"]
    for step in steps:
        layers = [step[f"sft/moe/load_max_over_mean/layer_{i}"] for i in range(4)]
        assert all(1.0 <= v <= 8 / 2 for v in layers) and step["sft/moe/load_max_over_mean"] == max(layers)
        assert step["sft/moe/dropped_token_fraction"] == 0.0  # dropless
        assert step["sft/moe/aux_loss"] > 0 and step["sft/moe/z_loss"] > 0
    from transformers import AutoConfig
    from tiny_models import all_tensors

    assert AutoConfig.from_pretrained(run / "hf_actor").architectures == ["Qwen3MoeForCausalLM"]
    assert sum(".mlp.experts." in name for name in all_tensors(run / "hf_actor")) == 4 * 8 * 3

    rl = tmp_path / "rl"
    proc = hybridflow("train", "--config", "examples/moe_arithmetic.yaml", f"model_path={run / 'hf_actor'}",
                      f"trainer.run_dir={rl}", "trainer.total_steps=2", "trainer.val_every=2", "trainer.save_every=0",
                      "trainer.plots=false", "trainer.logger=[jsonl]", "trainer.export_hf=false", "data.batch_size=8",
                      "data.val_size=8", "ppo.ppo_mini_batch_size=32", "actor.engine.micro_batch_size=4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    from hybridengine.model.spec import ModelSpec
    from hybridengine.parallel.layout import ParallelLayout
    from hybridengine.reshard.plan import GenerationLayout
    from hybridengine.reshard.weight_plan import plan_weights

    # TP1 x DP4 at EP2 into generation TP1: the dense part is where it is; each rank lacks 4 of 8 experts a layer.
    plan = plan_weights(ModelSpec.from_pretrained(run / "hf_actor"), ParallelLayout(1, 1, 4, 2), GenerationLayout(1))
    bound = plan.experts.bound(0, 2)  # bf16
    assert plan.expected_bytes(0, 2) == 0 and bound == 4 * 4 * 64 * 3 * 128 * 2
    steps = read_metrics(rl)
    assert [m["step"] for m in steps if "actor/pg_loss" in m] == [1, 2]
    assert [m["step"] for m in steps if "val/reward/mean" in m] == [0, 2]  # before the first step, and at the end
    for step in (m for m in steps if "actor/pg_loss" in m):
        assert step["reshard/bytes_received"] == step["reshard/expert_bytes_received"] == bound
        # vLLM's and megatron's bf16 kernels on the same weights, the experts replayed: close on every token
        assert step["rollout/logprob_diff_max"] < 0.1 and step["rollout_corr/kl_k3"] < 1e-3
        assert 1.0 <= step["actor/moe/load_max_over_mean"] <= 8 / 2
        # The routers' own choice in the update's forward (on the rollout's weights, replaying the layers below)
        # against vLLM's on every prompt and response token: bf16 engines on the same weights mostly agree.
        layers = [step[f"router_replay/agreement/layer_{i}"] for i in range(4)]
        assert 0.9 <= min(layers) and step["router_replay/agreement"] == pytest.approx(sum(layers) / 4) and max(layers) <= 1.0


def test_lora_sft_resumes_exactly_and_its_adapter_starts_lora_grpo(tmp_path, model):  # noqa: F811
    """LoRA through both CLIs: an SFT job whose checkpoints hold the adapters only and resume exactly, whose
    PEFT export starts a LoRA GRPO job (``actor.lora.adapter_path``) with a KL loss against the base (the
    adapters off; verl's k3+: k3's value, k2's gradient), its vLLM rollout serving the adapters on the base (``rollout.lora_sync: adapter``): after
    the first step only the adapters' bytes move, and vLLM's log-probs are the actor's."""
    lora = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.engine.precision=fp32"]
    sft = [*SFT, "trainer.total_steps=2", "trainer.save_every=1", "trainer.val_every=0", *lora]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    proc = hybridflow("sft", "--config", "examples/sft_tiny.yaml", f"model_path={model}", f"trainer.run_dir={full}", *sft)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert f"PEFT adapter:   {full / 'lora_adapter'}" in proc.stdout
    steps = read_metrics(full)
    assert [s["step"] for s in steps] == [1, 2] and steps[1]["sft/loss"] < steps[0]["sft/loss"]
    checkpoint = full / "checkpoints" / "actor" / "step_00000001"
    saved = checkpoint_tensors(checkpoint)
    assert saved and all(".lora.lora_" in name for name in saved), sorted(saved)[:4]  # nothing of the frozen base
    # the adapters and Adam's two moments, in fp32: every linear of every layer, from the model's dimensions
    assert sum(saved.values()) * 4 == 12 * lora_parameter_count(model, rank=8)
    shutil.copytree(full, stopped)
    (stopped / "checkpoints" / "trainer" / "latest").write_text("step_00000001.json")
    proc = hybridflow("sft", "--config", "examples/sft_tiny.yaml", f"model_path={model}", f"trainer.run_dir={stopped}",
                      *sft, "trainer.resume=true", "trainer.export_hf=false")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert [exact(s) for s in read_metrics(stopped)] == [exact(s) for s in steps]

    rl = tmp_path / "rl"
    proc = hybridflow("train", "--config", "examples/ppo_tiny.yaml", f"trainer.run_dir={rl}", f"model_path={model}",
                      *TINY, *lora, f"actor.lora.adapter_path={full / 'lora_adapter'}", "trainer.launcher=torchrun",
                      "trainer.nproc=2", "actor.engine.tensor_parallel=2", "rollout.engine=vllm",
                      "rollout.lora_sync=adapter",
                      "algorithm.name=grpo", "rollout.sampling.n=2", "ppo.ppo_mini_batch_size=8", "ppo.ppo_epochs=1",
                      "ppo.use_kl_loss=true", "ppo.kl_loss_type=k3+", "reward.fn=arithmetic_answer", "trainer.total_steps=2",
                      "trainer.export_hf=true")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert third_party_lines(proc.stdout) == [], proc.stdout[-3000:]  # vLLM's LoRA serving is quiet too
    first, second = read_metrics(rl)
    assert first["actor/kl_loss"] > 1e-4  # the SFT adapters moved the policy from the base, its reference
    for step in (first, second):  # vLLM generated with the adapters (fp32: as the actor computes)
        assert step["rollout/logprob_diff_max"] < 1e-3, step["rollout/logprob_diff_max"]
        assert step["weight_sync/bytes"] == 4 * lora_parameter_count(model, rank=8)  # the adapters whole, fp32
    assert second["reshard/bytes_received"] == second["reshard/lora_bytes_received"] > 0
    assert first["reshard/bytes_received"] > 10 * second["reshard/bytes_received"]
    assert (rl / "hf_actor" / "config.json").is_file() and (rl / "lora_adapter" / "adapter_config.json").is_file()


def checkpoint_tensors(path) -> dict[str, int]:
    """The elements of each tensor a megatron checkpoint directory holds, by its key."""
    import math

    from torch.distributed.checkpoint import FileSystemReader

    entries = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {name: math.prod(entry.size) for name, entry in entries.items() if hasattr(entry, "size")}


def lora_parameter_count(path, rank: int) -> int:
    from hybridengine.model.spec import ModelSpec
    from tiny_models import projection_shapes

    spec = ModelSpec.from_pretrained(path)
    return spec.num_layers * sum(rank * (fan_in + fan_out) for fan_in, fan_out in projection_shapes(spec).values())


def test_calculator_transcripts_warm_start_agentic_grpo(tmp_path):
    """The tool-use pipeline on the tiny chat model: SFT on calculator transcripts (the tools in its system
    message, the calls in hermes format), then GRPO of the calculator agent from its export, two steps each."""
    sft = tmp_path / "sft"
    proc = hybridflow("sft", "--config", "examples/calculator_sft.yaml", "model_path=builtin:tiny-chat",
                      f"trainer.run_dir={sft}", "trainer.total_steps=2", "trainer.val_every=2", "data.train_size=16",
                      "data.val_size=8", "data.batch_size=8", "actor.engine.micro_batch_size=4", "actor.optim.lr=1e-3",
                      "trainer.plots=false", "trainer.logger=[jsonl]")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    steps = read_metrics(sft)
    assert [s["step"] for s in steps] == [1, 2] and steps[1]["sft/loss"] < steps[0]["sft/loss"]
    rl = tmp_path / "rl"
    proc = hybridflow("train", "--config", "examples/calculator_agent.yaml", f"model_path={sft / 'hf_actor'}",
                      f"trainer.run_dir={rl}", "trainer.total_steps=2", "trainer.val_every=2",
                      "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.export_hf=false",
                      "trainer.plots=false", "data.batch_size=4", "data.train_size=32", "data.val_size=4",
                      "rollout.sampling.n=2", "rollout.sampling.max_new_tokens=16", "rollout.agent.max_response_length=64",
                      "ppo.ppo_mini_batch_size=8", "actor.engine.micro_batch_size=4", "rollout.kv_cache_bytes=67108864",
                      "rollout.max_prompt_length=640")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert third_party_lines(proc.stdout) == [], proc.stdout[-3000:]
    steps = read_metrics(rl)
    assert [s["step"] for s in steps] == [1, 2] and "val/reward/mean" in steps[1]
    assert all("agent/tool_calls/mean" in s and 1 <= s["agent/num_turns/mean"] <= 3 for s in steps)
