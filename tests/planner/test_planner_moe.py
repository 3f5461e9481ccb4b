"""The planner on a mixture of experts, with no process: the active FLOPs, the all-to-all, the expert-parallel
layouts it searches (against brute force), memory choosing EP, and `hybridflow plan` writing EP overrides the
job accepts."""

import json
from dataclasses import replace

import pytest

from conftest import ROOT
from controller.cli import main
from controller.config import check_config, load_config
from controller.planner.hardware import Cluster
from controller.planner.memory import ActivationShape, dtype_bytes, state_memory
from controller.planner.options import Pin, evaluate_option, links_for, role_options
from controller.planner.search import search
from controller.planner.timing import Efficiency, all_to_all_time, model_flops_per_token
from controller.planner.workload import RoleWork, Workload
from hybridengine.model.spec import ModelSpec
from test_moe_layout import QWEN3_MOE
from test_planner_search import _brute_force, toy_device

# Experts that dominate the weights (8 x 2 layers x 3 x 64 x 96), so that expert parallelism decides memory.
MOE = ModelSpec.from_hf_config({**QWEN3_MOE, "moe_intermediate_size": 96})


def moe_workload(sequences=16, mini=8) -> Workload:
    roles = (RoleWork("actor", MOE, trains=True, forward_passes=1, mini_batch=mini, generates=True),
             RoleWork("ref_policy", MOE, trains=False, forward_passes=1))
    return Workload(sequences, 32, 32, roles, max_num_seqs=8)


def test_flops_count_the_router_and_the_k_experts_a_token_goes_through():
    spec = ModelSpec.from_hf_config(QWEN3_MOE)  # 8 experts, top-2, expert FFN 32, no shared expert
    h, d = spec.hidden_size, spec.head_dim
    attention = h * (spec.num_attention_heads + 2 * spec.num_query_groups) * d + spec.num_attention_heads * d * h
    mlp = h * 8 + 3 * h * 2 * 32  # the router, then gate, up and down of 2 experts
    assert model_flops_per_token(spec) == 2.0 * (spec.num_layers * (attention + mlp) + spec.vocab_size * h)
    shared = ModelSpec.from_hf_config({**QWEN3_MOE, "architectures": ["Qwen2MoeForCausalLM"],
                                       "shared_expert_intermediate_size": 48})
    assert model_flops_per_token(shared) - model_flops_per_token(spec) == 2.0 * spec.num_layers * (3 * h * 48 + h)


def test_expert_parallelism_adds_the_all_to_all_and_cuts_the_experts_state():
    """At the same TP x PP x DP, EP changes no compute: a forward pass takes longer by exactly the dispatch and
    combine of each micro-batch's k copies of every token per layer, and each rank holds 1/EP of the experts."""
    workload, cluster, efficiency = moe_workload(), Cluster(1, 4, toy_device(64)), Efficiency()
    work = workload.role("ref_policy")
    one = evaluate_option(work, workload, cluster, efficiency, 4, 1, 1, 2)
    two = evaluate_option(work, workload, cluster, efficiency, 4, 1, 1, 2, ep=2)
    micro = 16 // 4 // 2  # sequences per DP rank over the micro-batch
    tokens = 2 * workload.seq_len
    share = tokens * 2 * MOE.hidden_size * dtype_bytes("bf16")  # k = 2 copies of each token
    exchange = micro * MOE.num_layers * 2 * all_to_all_time(share, 2, links_for(cluster, 2), efficiency)
    assert two.times[1] - one.times[1] == pytest.approx(exchange, rel=1e-9) and exchange > 0
    padded = work.padded(1)  # the vocabulary as the engine pads it
    assert one.resident == state_memory(padded, 1, 1, 4, "bf16", False).total
    assert two.resident == state_memory(padded, 1, 1, 4, "bf16", False, ep=2).total < one.resident
    assert (two.ep, two.etp) == (2, None) and "EP2" in two.layout


def test_the_search_over_expert_parallel_layouts_finds_the_brute_force_optimum():
    workload, efficiency, cluster = moe_workload(), Efficiency(), Cluster(1, 4, toy_device(8.0))
    result = search(workload, cluster, efficiency, top=3)
    expected = _brute_force(workload, cluster, efficiency)  # every option, EP and ETP included, scored again
    found = {p.placement: p.step_time for p in result.plans}
    found.update({r.placement: r.best.step_time for r in result.rejected if r.best is not None})
    assert expected and found.keys() == expected.keys()
    for placement, step in expected.items():
        assert found[placement] == pytest.approx(step, rel=1e-12), placement
    layouts = {(o.tp, o.pp, o.ep, o.etp) for o in role_options(workload.role("actor"), workload, cluster, efficiency, 4,
                                                                 prune=False)}
    assert {(1, 1, 2, None), (1, 1, 4, None), (2, 1, 2, 1), (2, 1, 4, 1)} <= layouts  # EP, experts cut or whole


def test_memory_chooses_expert_parallelism_where_tp_and_pp_are_pinned():
    """Each rank holding every expert (EP1) does not fit 8 MiB at TP1 x PP1; EP2 and EP4 hold half and a
    quarter, and the search takes one. With room, EP1 is among the options again."""
    workload, efficiency = moe_workload(), Efficiency()
    pins = {"actor": Pin(tp=1, pp=1), "ref_policy": Pin(tp=1, pp=1)}
    tight = search(workload, Cluster(1, 4, toy_device(8.0)), efficiency, pins=pins)
    assert tight.plans and all(o.ep > 1 for s in tight.plans[0].sets for o in s.options if o.role == "actor")
    assert all(max(s.memory) <= 8 * 2**20 for s in tight.plans[0].sets)
    actor = workload.role("actor")
    assert {o.ep for o in role_options(actor, workload, Cluster(1, 4, toy_device(8.0)), efficiency, 4, pins["actor"])} \
        == {2, 4}
    assert 1 in {o.ep for o in role_options(actor, workload, Cluster(1, 4, toy_device(64)), efficiency, 4, pins["actor"])}


def test_plan_writes_expert_parallel_overrides_the_job_accepts(tmp_path, capsys):
    out = tmp_path / "plans.json"
    args = ["plan", "--config", str(ROOT / "examples/moe_arithmetic.yaml"), "model_path=builtin:tiny-arithmetic-moe",
            "rollout.engine=vllm", "--cluster", "1x4xA10-24GB", "--pin", "actor.ep=2", "--json", str(out)]
    assert main(args) == 0
    assert "EP2" in capsys.readouterr().out
    plan = json.loads(out.read_text())["plans"][0]
    assert "actor.engine.expert_parallel=2" in plan["overrides"]
    config = load_config(ROOT / "examples/moe_arithmetic.yaml", ["model_path=builtin:tiny-arithmetic-moe",
                                                                  "rollout.engine=vllm", *plan["overrides"]])
    from controller.planner.workload import load_spec

    check_config(config, load_spec("builtin:tiny-arithmetic-moe"))


def test_moe_activations_hold_k_copies_of_each_token():
    from controller.planner.memory import layer_activation_bytes

    shape = ActivationShape(2, 32, "bf16")
    # the MoE formula is held to measured MoE layers as a whole: its attention part leaves the q/k norms out
    dense_attention = layer_activation_bytes(replace(MOE, moe=None, ffn_hidden_size=0, qk_layernorm=False), 1, shape)
    moe = MOE.moe
    per_token = moe.topk * (2 * MOE.hidden_size + 5 * moe.expert_ffn_hidden_size) * 2 + 2 * moe.num_experts * 4
    assert layer_activation_bytes(MOE, 1, shape) == dense_attention + 2 * 32 * per_token
