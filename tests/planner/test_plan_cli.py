"""``hybridflow plan`` end to end on config-only models: the plans, --write's overrides, --json, the exits."""

import json

import pytest

from conftest import ROOT
from controller.cli import main
from controller.config import check_config, load_config
from hybridengine.model.spec import ModelSpec

MODELS = ROOT / "examples" / "models"
PAPER_7B = ["--config", str(ROOT / "examples/paper_ppo.yaml"), f"model_path={MODELS / 'llama2-7b'}",
            f"reward.model_path={MODELS / 'llama2-7b-reward'}"]


def test_plan_prints_ranked_plans_and_writes_overrides_the_job_accepts(tmp_path, capsys):
    out = tmp_path / "plans.json"
    assert main(["plan", *PAPER_7B, "--cluster", "2x8xA100-80GB", "--write", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "#1 " in text and "other placements:" in text and "hybridflow train" in text
    saved = json.loads(out.read_text())
    assert saved["cluster"] == "2x8xA100-80GB" and saved["roles"] == ["actor", "critic", "ref_policy", "reward_model"]
    steps = [p["step_time_s"] for p in saved["plans"]]
    assert steps == sorted(steps) and 1 <= len(steps) <= 5
    usable = saved["usable_bytes_per_device"]
    assert all(m <= usable for p in saved["plans"] for s in p["sets"] for m in s["memory_bytes"].values())
    assert sum(s["devices"] for s in saved["plans"][0]["sets"]) == 16
    # The overrides make a config that passes the pre-launch checks with the models' own shapes.
    overrides = saved["plans"][0]["overrides"]
    config = load_config(ROOT / "examples/paper_ppo.yaml", [*PAPER_7B[2:], *overrides])
    check_config(config, ModelSpec.from_pretrained(MODELS / "llama2-7b"),
                 reward_spec=ModelSpec.from_pretrained(MODELS / "llama2-7b-reward"))
    losers = saved["rejected"]
    assert losers and all(r["reason"].startswith(("slower", "out of memory")) for r in losers)


def test_a_job_too_large_for_the_cluster_exits_1_with_the_smallest_plans_memory(capsys):
    args = ["plan", "--config", str(ROOT / "examples/paper_ppo.yaml"), f"model_path={MODELS / 'llama2-70b'}",
            f"reward.model_path={MODELS / 'llama2-70b-reward'}", "--cluster", "1x2xA10-24GB"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "fits no plan on 1x2xA10-24GB" in err and "GiB on a device" in err and "22.00 GiB usable" in err


def test_bad_devices_and_pins_exit_2_naming_the_value(capsys):
    cases = [
        (["--cluster", "2x8xV100"], "unknown accelerator 'V100'"),
        (["--cluster", "2x8xA100-80GB", "--pin", "actor.tp=3"], "--pin actor.tp=3"),
        (["--cluster", "2x8xA100-80GB", "--pin", "actor.tp=16"], "TP stays within a node, which has 8 devices"),
        (["--cluster", "2x8xA100-80GB", "--pin", "critic.colour=2"], "unknown key 'colour'"),
        (["--cluster", "2x8xA100-80GB", "--pin", "cost.tp=2"], "the job has no role 'cost'"),
        (["--cluster", "2x8xA100-80GB", "--pin", "actor.devices=32"], "the cluster has 16 devices"),
        (["--cluster", "2x8xA100-80GB", "--pin", "actor.tp=2", "--pin", "actor.tp=4"], "given twice"),
    ]
    for extra, message in cases:
        assert main(["plan", *PAPER_7B, *extra]) == 2, extra
        assert message in capsys.readouterr().err, (extra, message)


def test_a_vision_language_job_plans_its_tower_and_image_tokens(tmp_path, capsys):
    """Qwen2.5-VL-7B: each device of the actor holds the tower (replicated over TP) beside its language-model shard,
    and the tower's work on the prompts' image tokens makes the step longer than the same job on its text twin."""
    vl = MODELS / "qwen2.5-vl-7b"
    config = json.loads((vl / "config.json").read_text())
    text = tmp_path / "text-twin"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({**config["text_config"], "architectures": ["Qwen2ForCausalLM"],
                                                  "model_type": "qwen2"}))
    job = ["--config", str(ROOT / "examples/vision/grpo_colour.yaml"), "rollout.max_prompt_length=1024",
           "rollout.sampling.max_new_tokens=512", "data.batch_size=64", "rollout.sampling.n=8",
           "ppo.ppo_mini_batch_size=256", "actor.engine.precision=bf16", "trainer.nproc=8"]
    plans = {}
    for name, model in (("vl", vl), ("text", text)):
        out = tmp_path / f"{name}.json"
        assert main(["plan", *job, f"model_path={model}", "--cluster", "1x8xA100-80GB", "--pin", "actor.tp=4",
                     "--json", str(out)]) == 0
        plans[name] = json.loads(out.read_text())["plans"][0]
    capsys.readouterr()
    tower = ModelSpec.from_pretrained(vl).vision.parameter_count
    assert 670e6 < tower < 680e6  # Qwen2.5-VL-7B's ViT and merger

    def actor(plan):
        return next(r for s in plan["sets"] for r in s["roles_detail"] if r["role"] == "actor")

    vl_set, text_set = actor(plans["vl"]), actor(plans["text"])
    assert (vl_set["tp"], text_set["tp"]) == (4, 4)
    assert vl_set["memory_bytes"]["weights"] - text_set["memory_bytes"]["weights"] == 2 * tower  # bf16, whole
    assert plans["vl"]["step_time_s"] > plans["text"]["step_time_s"]


def test_a_long_context_job_gets_context_parallelism_where_it_makes_the_job_fit(tmp_path, capsys):
    """Qwen3-8B, 1k-token prompts, 32k-token responses, 64 x 8 samples a step, 8 A100-80GB: at TP4 one
    sequence's activations do not fit a device, so the planner splits it over CP ranks; a job pinned to CP1 at TP4
    fits no plan, and its pre-launch check names the CP that fits."""
    from controller.planner.hardware import parse_cluster
    from controller.planner.prelaunch import MemoryCheckError, check_job_memory

    job = ["--config", str(ROOT / "examples/long_context/grpo_qwen3_8b_32k.yaml")]
    out = tmp_path / "plans.json"
    assert main(["plan", *job, "--cluster", "1x8xA100-80GB", "--pin", "actor.tp=4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TP4 CP2 PP1 DP1" in text
    sets = json.loads(out.read_text())["plans"][0]["sets"]
    actor = next(r for s in sets for r in s["roles_detail"] if r["role"] == "actor")
    assert actor["tp"] == 4 and actor["cp"] >= 2
    # CP1 at TP4: no plan
    assert main(["plan", *job, "--cluster", "1x8xA100-80GB", "--pin", "actor.tp=4", "--pin", "actor.cp=1"]) == 1
    assert "fits no plan on 1x8xA100-80GB" in capsys.readouterr().err
    config = load_config(ROOT / "examples/long_context/grpo_qwen3_8b_32k.yaml", ["actor.engine.context_parallel=1"])
    try:
        check_job_memory(config, parse_cluster("1x8xA100-80GB"))
        raise AssertionError("a 32k-token job at TP4 CP1 passed the memory check")
    except MemoryCheckError as exc:
        message = str(exc)
    assert "needs" in message and "in the training stage" in message
    assert "makes it fit at its own layout" in message and "actor.engine.context_parallel=2" in message
    # as written (CP2) the job passes
    check_job_memory(load_config(ROOT / "examples/long_context/grpo_qwen3_8b_32k.yaml"), parse_cluster("1x8xA100-80GB"))


def test_a_70b_teacher_is_placed_and_sized_beside_a_7b_student(tmp_path, capsys):
    """On-policy distillation: the teacher is a role of the plan (its own set or the student's), its layout among
    the overrides; on 2 GPUs the job fits no plan, and the pre-launch check counts the teacher's memory."""
    from controller.planner.hardware import parse_cluster
    from controller.planner.prelaunch import MemoryCheckError, check_job_memory

    example = ["--config", str(ROOT / "examples/distillation/opd_llama2_70b_to_7b.yaml")]
    out = tmp_path / "plans.json"
    assert main(["plan", *example, "--cluster", "8x8xA100-80GB", "--write", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["roles"] == ["actor", "teacher"]
    best = saved["plans"][0]
    teacher = next(s for s in best["sets"] if "teacher" in s["roles"])
    assert max(teacher["memory_bytes"].values()) <= saved["usable_bytes_per_device"]
    sized = next(r for r in teacher["roles_detail"] if r["role"] == "teacher")
    assert sized["memory_bytes"]["weights"] > 0 and sized["times_s"]["preparation"] > 0  # forward only
    assert sized["memory_bytes"]["optimizer"] == sized["times_s"]["training"] == 0
    overrides = best["overrides"]
    config = load_config(example[1], overrides)
    tp = next(int(o.split("=")[1]) for o in overrides if o.startswith("teacher.engine.tensor_parallel="))
    assert config.roles["teacher"].engine.tensor_parallel == tp
    assert "teacher" in capsys.readouterr().out

    assert main(["plan", *example, "--cluster", "1x2xA100-80GB"]) == 1
    assert "the job fits no plan on 1x2xA100-80GB" in capsys.readouterr().err
    with pytest.raises(MemoryCheckError) as refused:  # the job's own layout on one node of 8
        check_job_memory(load_config(example[1], ["trainer.nproc=8"]), parse_cluster("1x8xA100-80GB"))
    assert "the pool of actor+teacher needs" in str(refused.value)
    assert "teacher.engine.pipeline_parallel=" in str(refused.value)  # the nearest plan that fits sets its layout


def test_a_70b_judge_is_placed_and_sized_beside_a_7b_actor(tmp_path, capsys):
    """A generative judge: its engine's weights and KV cache held all step, its verdicts generated in the scoring
    phase (its time there, none in generation or training); on 2 GPUs the job fits no plan."""
    from controller.planner.hardware import parse_cluster
    from controller.planner.prelaunch import job_plan

    example = ["--config", str(ROOT / "examples/judge/grpo_judge_llama2_70b_7b.yaml")]
    out = tmp_path / "plans.json"
    assert main(["plan", *example, "--cluster", "8x8xA100-80GB", "--write", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["roles"] == ["actor", "judge"]
    for plan in saved["plans"]:
        judge = next(r for s in plan["sets"] for r in s["roles_detail"] if r["role"] == "judge")
        assert judge["memory_bytes"]["KV cache"] > 0 and judge["state_bytes"] >= judge["memory_bytes"]["KV cache"]
        assert judge["times_s"]["generation"] > 0 and judge["times_s"]["training"] == 0
        assert all(max(s["memory_bytes"].values()) <= saved["usable_bytes_per_device"] for s in plan["sets"])
    overrides = saved["plans"][0]["overrides"]
    config = load_config(example[1], overrides)
    tp = next(int(o.split("=")[1]) for o in overrides if o.startswith("reward.judge.tensor_parallel="))
    assert config.reward.judge.tensor_parallel == tp and config.reward.judge.kv_cache_bytes > 0
    # the step's stages: the judge's generation sits in the preparation stage (scoring), before the log-probs
    plan = job_plan(config, parse_cluster("8x8xA100-80GB"))
    assert plan.stage_times[1] > sum(next(o for g in plan.sets for o in g.options if o.role == "judge").times) * 0.99
    capsys.readouterr()

    assert main(["plan", *example, "--cluster", "1x2xA100-80GB"]) == 1
    assert "the job fits no plan on 1x2xA100-80GB" in capsys.readouterr().err
    from controller.planner.prelaunch import MemoryCheckError, check_job_memory

    with pytest.raises(MemoryCheckError) as refused:  # the job's own layout (a judge at TP1) on one node of 8
        check_job_memory(load_config(example[1], ["trainer.nproc=8"]), parse_cluster("1x8xA100-80GB"))
    assert "the pool of actor+judge needs" in str(refused.value)
    assert "reward.judge.tensor_parallel=8" in str(refused.value)  # the nearest plan that fits
