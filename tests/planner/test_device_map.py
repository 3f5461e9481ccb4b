"""``device_map="auto"`` through the planner, with no process: the layouts it picks against every legal layout
scored one by one by the pre-launch model (``job_plan``), the user's own layouts kept, and a clear error."""

import itertools
from pathlib import Path

import pytest

from controller.config import load_config
from controller.planner.device_map import auto_layouts
from controller.planner.hardware import Cluster, parse_cluster
from controller.planner.prelaunch import job_plan
from hybridengine.model.spec import ModelConfigError

ROOT = Path(__file__).parent.parent.parent
PAPER_7B = ["model_path=examples/models/llama2-7b", "reward.model_path=examples/models/llama2-7b-reward",
            "trainer.nproc=8", "data.batch_size=256", "ppo.ppo_mini_batch_size=64", "critic_ppo.ppo_mini_batch_size=64"]


def brute_force(overrides: list[str], roles: list[str], cluster: Cluster) -> tuple:
    """Every legal (TP, PP) of each role in ``roles`` and generation TP, scored by job_plan; the fastest that fits."""
    best = None
    sections = {"actor": "actor.engine", "critic": "critic.engine", "ref_policy": "ref_policy.engine",
                "reward_model": "reward.engine"}
    sizes = [(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if cluster.devices % (tp * pp) == 0]
    for combo in itertools.product(sizes, repeat=len(roles)):
        for gen_tp in (1, 2, 4, 8):
            layout = [f"rollout.tensor_parallel={gen_tp}"]
            for role, (tp, pp) in zip(roles, combo):
                layout += [f"{sections[role]}.tensor_parallel={tp}", f"{sections[role]}.pipeline_parallel={pp}"]
            config = load_config(ROOT / "examples/paper_ppo.yaml", [*overrides, *layout])
            try:
                plan = job_plan(config, cluster)
            except (ValueError, ModelConfigError):
                continue  # a layout that does not divide the model or the devices
            if config.actor.engine.tensor_parallel % gen_tp:
                continue  # the hybrid engine reaches generation TPs dividing the training TP
            if any(max(s.memory) > cluster.accelerator.usable_bytes for s in plan.sets):
                continue
            if best is None or plan.step_time < best[0] - 1e-12:
                best = (plan.step_time, {**dict(zip(roles, combo)), "rollout": (gen_tp, 1)})
    return best


def test_the_auto_roles_get_the_fastest_layouts_that_fit_and_the_others_keep_theirs():
    cluster = parse_cluster("1x8xA100-80GB")
    # The critic laid out by the user (TP 2 x PP 1); the actor, the reference and the rollout on auto.
    overrides = [*PAPER_7B, "critic.engine.tensor_parallel=2"]
    config = load_config(ROOT / "examples/paper_ppo.yaml", overrides)
    auto = {"actor", "ref_policy", "rollout"}
    layouts = auto_layouts(config, auto, cluster)
    assert set(layouts) == auto
    expected = brute_force(overrides, ["actor", "ref_policy"], cluster)
    assert expected is not None
    # (TP, PP, CP): short sequences need no context parallelism
    assert {role: layout[:2] for role, layout in layouts.items()} == expected[1], (layouts, expected)
    assert all(layout[2] == 1 for layout in layouts.values())
    chosen = load_config(ROOT / "examples/paper_ppo.yaml", [*overrides, *[
        f"{section}.{key}={value}" for role, section in (("actor", "actor.engine"), ("ref_policy", "ref_policy.engine"))
        for key, value in zip(("tensor_parallel", "pipeline_parallel"), layouts[role][:2])],
        f"rollout.tensor_parallel={layouts['rollout'][0]}"])
    assert job_plan(chosen, cluster).step_time == pytest.approx(expected[0], rel=1e-12)


def test_a_job_that_fits_no_layout_is_refused_naming_what_it_needs():
    cluster = parse_cluster("1x2xA100-40GB")
    config = load_config(ROOT / "examples/paper_ppo.yaml", [*PAPER_7B, "trainer.nproc=2", "data.batch_size=64",
                                                            "ppo.ppo_mini_batch_size=16", "critic_ppo.ppo_mini_batch_size=16"])
    with pytest.raises(ValueError, match=r'device_map="auto" \(actor, critic\): the job fits no layout on .*'
                                         r"GiB usable a device\): its smallest layout needs \d+\.\d+ GiB on a device"):
        auto_layouts(config, {"actor", "critic"}, cluster)


def test_a_reward_classifier_megatron_cannot_hold_is_left_out_of_the_plan(tmp_path):
    # A DeBERTa classifier runs on transformers in its own worker: the planner has no layout to give it.
    (tmp_path / "config.json").write_text('{"architectures": ["DebertaV2ForSequenceClassification"], '
                                          '"model_type": "deberta-v2", "hidden_size": 64}')
    from controller.planner.workload import job_workload

    config = load_config(ROOT / "examples/paper_ppo.yaml", [*PAPER_7B, f"reward.model_path={tmp_path}"])
    assert job_workload(config).role_names == ("actor", "critic", "ref_policy")
    layouts = auto_layouts(config, {"actor", "critic", "ref_policy", "reward_model"}, parse_cluster("1x8xA100-80GB"))
    assert set(layouts) == {"actor", "critic", "ref_policy"}


def test_a_lora_actor_is_its_own_reference_and_holds_state_for_its_adapters_only():
    """With actor.lora the plan holds no reference model (the actor's base answers it, one more forward pass),
    and the actor's gradients and optimizer state are its adapters' (``lora_state``), by the formula."""
    from controller.planner.memory import lora_numels, state_memory
    from controller.planner.workload import job_workload
    from tiny_models import projection_shapes

    lora = ["actor.lora.rank=16", "actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"]
    full, adapted = (job_workload(load_config(ROOT / "examples/paper_ppo.yaml", [*PAPER_7B, *extra]))
                     for extra in ([], lora))
    assert full.role_names == ("actor", "critic", "ref_policy", "reward_model")
    assert adapted.role_names == ("actor", "critic", "reward_model")
    actor = adapted.roles[0]
    assert actor.forward_passes == full.roles[0].forward_passes + 1
    assert (actor.lora_rank, actor.lora_targets) == (16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    spec = actor.padded(2)
    shapes = projection_shapes(spec)
    per_layer = sum(16 * (fan_in + fan_out) for part, (fan_in, fan_out) in shapes.items() if part in "qkvo")
    assert sum(n for n, _ in lora_numels(spec, 1, 1, 0, 16, actor.lora_targets)) == per_layer * spec.num_layers
    whole = state_memory(spec, 2, 1, 4, "bf16", True)
    mine = state_memory(spec, 2, 1, 4, "bf16", True, lora_rank=16, lora_targets=actor.lora_targets)
    count = sum(n for n, _ in lora_numels(spec, 2, 1, 0, 16, actor.lora_targets))
    assert mine.weights == whole.weights + 2 * count  # the base, and the adapters in bf16
    assert mine.gradients == 4 * count and mine.optimizer == 12 * count + 4 * 8 * spec.num_layers
    assert mine.total < whole.total / 3
