"""``rollout.lora_sync: auto`` with no process: the LoRA sync's memory figures against PEFT's and HF's own
parameter counts, and the choice between merging and serving the adapters on clusters where each wins (by
memory, by time), or where only one can run."""

from dataclasses import replace
from pathlib import Path

import pytest

from controller.config import load_config
from controller.planner.hardware import parse_cluster
from controller.planner.lora_choice import choose_lora_sync, resolve_lora_sync
from controller.planner.memory import lora_adapter_bytes, lora_merged_bytes
from controller.planner.prelaunch import job_plan
from controller.planner.report import plan_overrides
from controller.planner.search import search
from controller.planner.timing import Efficiency
from controller.planner.workload import job_workload

ROOT = Path(__file__).parent.parent.parent
# GRPO of Llama-2-7B, 256 sequences of 1024 + 1024 tokens a step, LoRA rank 16 on every linear, TP1 everywhere
GRPO_7B = ["model_path=examples/models/llama2-7b", "reward.model_path=null", "reward.fn=arithmetic",
           "algorithm.name=grpo", "rollout.sampling.n=4", "data.batch_size=64", "ppo.ppo_mini_batch_size=64",
           "actor.lora.rank=16", "rollout.kv_cache_bytes=8000000000", "trainer.nproc=1"]


def _config(*extra: str):
    return load_config(ROOT / "examples/paper_ppo.yaml", [*GRPO_7B, *extra])


def test_the_sync_memory_figures_are_peft_and_hf_parameter_counts(tmp_path):
    """The adapters whole (what crosses to a rollout pool) are PEFT's adapter parameters; the merged linears of a
    generation shard are HF's targeted linears cut over the generation TP."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hybridengine.model.spec import ModelSpec
    from tests.tiny_models import make_llama

    path = make_llama(tmp_path / "llama", heads=4, kv_heads=2, head_dim=16, layers=2)
    spec = ModelSpec.from_pretrained(path)
    for targets in (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                    ("o_proj", "down_proj")):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        linears = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-2] in targets)
        peft = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets)))
        adapters = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
        assert lora_adapter_bytes(spec, 1, 1, "bf16", 4, targets) == adapters * 2
        for gen_tp in (1, 2):
            assert lora_merged_bytes(spec, gen_tp, 1, "bf16", targets) == linears * 2 // gen_tp
        assert lora_merged_bytes(spec, 1, 2, "fp32", targets) == linears * 4 // 2  # one stage of two


def test_merge_wins_on_time_where_both_fit_and_adapter_where_merging_does_not():
    config = _config()
    spec_bytes = lora_merged_bytes(job_workload(config).role("actor").spec, 1, 1, "bf16",
                                   config.actor.lora.targets)
    served = lora_adapter_bytes(job_workload(config).role("actor").spec, 1, 1, "bf16", 16, config.actor.lora.targets)
    # An H100: both fit; vLLM's LoRA kernels cost more than a bandwidth-bound merge.
    h100 = choose_lora_sync(config, parse_cluster("1xH100-80GB"))
    merge, adapter = h100.plans["merge"], h100.plans["adapter"]
    assert h100.mode == "merge" and merge.step_time < adapter.step_time
    assert "both fit" in h100.reason and f"{merge.step_time:.3g} s a step" in h100.reason
    # What merging holds beyond serving, in the generation stage: the merged linears, less vLLM's adapter slots.
    assert merge.sets[0].memory[0] - adapter.sets[0].memory[0] == spec_bytes - served
    assert merge.sets[0].memory[2] - adapter.sets[0].memory[2] == spec_bytes  # kept while training too
    assert merge.peak_memory <= parse_cluster("1xH100-80GB").accelerator.usable_bytes
    # An A100-40GB: the merged linears do not fit beside the rest; served, the job does.
    a100 = choose_lora_sync(config, parse_cluster("1xA100-40GB"))
    usable = parse_cluster("1xA100-40GB").accelerator.usable_bytes
    assert a100.plans["merge"].peak_memory > usable >= a100.plans["adapter"].peak_memory
    assert a100.mode == "adapter" and a100.reason.startswith("merging needs")
    # Too small for either: merge, and the pre-launch memory check will say why.
    tiny = choose_lora_sync(config, parse_cluster("1xA10-24GB"))
    assert tiny.mode == "merge" and tiny.reason.startswith("neither fits")


def test_the_choice_follows_the_cost_of_serving():
    """With free LoRA kernels, serving saves the merge and wins on time; at this CPU's measured 6.3x it loses."""
    config = _config()
    cluster = parse_cluster("1xH200")
    free = choose_lora_sync(config, cluster, Efficiency(lora_decode_overhead=0.0))
    assert free.mode == "adapter" and free.plans["adapter"].step_time < free.plans["merge"].step_time
    cpu_like = choose_lora_sync(config, cluster, Efficiency(lora_decode_overhead=5.3))
    assert cpu_like.mode == "merge"
    gap = cpu_like.plans["adapter"].stage_times[0] - free.plans["adapter"].stage_times[0]
    generation = free.plans["adapter"].stage_times[0]
    assert gap > 4 * generation  # 5.3 x the generation, less what the load takes


def test_only_one_mode_where_the_other_cannot_run():
    cluster = parse_cluster("1xA100-40GB")  # where serving would win on memory
    megatron = choose_lora_sync(_config("rollout.engine=megatron"), cluster)
    assert megatron.mode == "merge" and list(megatron.plans) == ["merge"]
    assert "megatron engine takes the adapters merged" in megatron.reason
    set_by_user = choose_lora_sync(_config("rollout.lora_sync=merge"), cluster)
    assert set_by_user.mode == "merge" and set_by_user.reason == "set by rollout.lora_sync"
    high_rank = choose_lora_sync(_config("actor.lora.rank=1024"), cluster)  # vLLM serves ranks up to 512
    assert list(high_rank.plans) == ["merge"]
    with pytest.raises(ValueError, match="actor.lora.rank is 0"):
        choose_lora_sync(_config("actor.lora.rank=0"), cluster)


def test_resolve_writes_the_choice_into_the_config():
    cluster = parse_cluster("1xA100-40GB")
    resolved, choice = resolve_lora_sync(_config(), cluster)
    assert resolved.rollout.lora_sync == choice.mode == "adapter"
    kept, none = resolve_lora_sync(_config("rollout.lora_sync=merge"), cluster)
    assert kept.rollout.lora_sync == "merge" and none is None
    full, none = resolve_lora_sync(_config("actor.lora.rank=0"), cluster)
    assert full.rollout.lora_sync == "merge" and none is None
    # job_plan of an auto config scores the chosen mode
    assert job_plan(_config(), cluster).step_time == choice.plan.step_time
    # A served agent whose requests take each update in flight cannot be served unmerged adapters (vLLM keeps a
    # request on the adapter it started with): merge, whatever the scores, and the reason says so.
    served = ["rollout.server=true", "rollout.agent={entrypoint: 'examples.agents.openai_calculator:agent'}",
              "trainer.mode=async"]
    h200, free = parse_cluster("1xH200"), Efficiency(lora_decode_overhead=0.0)  # where serving wins on time
    finishing, kept = resolve_lora_sync(_config(*served, "rollout.server_update=finish"), h200, free)
    assert finishing.rollout.lora_sync == kept.mode == "adapter"
    in_flight, why = resolve_lora_sync(_config(*served), h200, free)
    assert in_flight.rollout.lora_sync == why.mode == "merge" and "in flight" in why.reason
    assert why.plans == kept.plans  # scored as before


def test_a_rollout_pool_receives_the_adapters_each_step_and_keeps_the_base():
    config = _config("trainer.mode=one_step_off", "trainer.placement.rollout={nodes: 1, processes_per_node: 1}")
    cluster = parse_cluster("1x2xH100-80GB")
    choice = choose_lora_sync(config, cluster)
    for mode, plan in choice.plans.items():
        rollout = plan.option("rollout")
        spec = job_workload(config).role("rollout").spec
        whole = lora_adapter_bytes(spec, 1, 1, "bf16", 16, config.actor.lora.targets)
        assert rollout.transfer_bytes == whole and rollout.lora_sync == mode
        assert rollout.memory["generation base"] == rollout.memory["weights"]  # the base kept beside vLLM's copy
        full = job_plan(_config("actor.lora.rank=0", "trainer.mode=one_step_off",
                                "trainer.placement.rollout={nodes: 1, processes_per_node: 1}"), cluster)
        assert plan.transfer_time < full.transfer_time / 50  # the adapters, not the model


def test_the_search_chooses_the_mode_and_writes_it():
    config = _config("trainer.nproc=2")
    workload = job_workload(config)
    cluster = parse_cluster("1x2xA100-40GB")
    best = search(workload, cluster, top=1).plans[0]
    generating = next(o for s in best.sets for o in s.options if o.gen_tp is not None)
    assert generating.lora_sync in ("merge", "adapter")
    overrides = plan_overrides(best, cluster)
    assert f"rollout.lora_sync={generating.lora_sync}" in overrides
    pinned = search(replace(workload, lora_sync="merge"), cluster, top=1).plans
    assert all(o.lora_sync in (None, "merge") for p in pinned for s in p.sets for o in s.options)


def test_the_jobs_resolve_applies_the_planners_choices_to_a_config_and_nothing_else():
    """controller.rl.resolve: the same choice as resolve_lora_sync, on a config it does not change; the cluster
    asked for only where a choice needs it; a config with nothing to choose comes back as it was."""
    from controller.algorithms import build_algorithm
    from controller.rl.resolve import resolve

    cluster, asked = parse_cluster("1xA100-40GB"), []

    def cluster_of():
        asked.append(1)
        return cluster, Efficiency()

    config = _config()
    resolved = resolve(config, build_algorithm(config.algorithm), config.model_path, cluster_of, flash_attention=True)
    direct, choice = resolve_lora_sync(config, cluster)
    assert resolved.config.rollout == direct.rollout and resolved.lora_sync.mode == choice.mode == "adapter"
    assert resolved.notes == (f"rollout.lora_sync auto -> adapter: {choice.reason}",)
    assert config.rollout.lora_sync == "auto" and asked == [1]  # the input untouched; one look at the cluster
    settled = _config("rollout.lora_sync=merge")
    again = resolve(settled, build_algorithm(settled.algorithm), settled.model_path, cluster_of, flash_attention=True)
    assert again.config == settled and again.lora_sync is None and again.notes == () and asked == [1]
