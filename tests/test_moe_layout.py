"""Mixtures of experts without a process: the config read, the expert grid against megatron's own rank
generator, and every bad layout refused before launch with the value and what would work."""

import pytest

from controller.config import ConfigError, check_config, load_config
from controller.sft.config import check_sft_config, load_sft_config
from hybridengine.model.catalogue import ExpertShard, lookup, stage_params
from hybridengine.model.spec import ModelConfigError, ModelSpec
from hybridengine.parallel.layout import ParallelLayout
from workers.megatron.config import EngineConfig
from test_config import EXAMPLES

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 256,
    "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
QWEN2_MOE = {**QWEN3_MOE, "architectures": ["Qwen2MoeForCausalLM"], "norm_topk_prob": False, "num_experts": 4,
             "shared_expert_intermediate_size": 48}


def test_the_families_read_their_experts():
    qwen3, qwen2 = ModelSpec.from_hf_config(QWEN3_MOE), ModelSpec.from_hf_config(QWEN2_MOE)
    assert (qwen3.moe.num_experts, qwen3.moe.topk, qwen3.moe.expert_ffn_hidden_size) == (8, 2, 32)
    assert qwen3.qk_layernorm and not qwen3.qkv_bias and qwen3.moe.norm_topk_prob and not qwen3.moe.has_shared_expert
    assert qwen2.qkv_bias and not qwen2.moe.norm_topk_prob and qwen2.moe.shared_expert_ffn_hidden_size == 48
    with pytest.raises(ModelConfigError, match=r"mlp_only_layers \[1\] .* make some of the 4 layers dense"):
        ModelSpec.from_hf_config({**QWEN3_MOE, "mlp_only_layers": [1]})


def test_expert_layouts_are_checked_against_the_model():
    spec = ModelSpec.from_hf_config(QWEN3_MOE)
    spec.check_layout(2, 2, 8, 1)
    with pytest.raises(ModelConfigError, match=r"expert_parallel 3 does not divide the 8 experts; valid EP sizes: \[1, 2, 4, 8\]"):
        spec.check_layout(1, 1, 3)
    with pytest.raises(ModelConfigError, match=r"expert_tensor_parallel 3 does not divide the experts' FFN hidden size 32"):
        spec.check_layout(1, 1, 2, 3)
    dense = ModelSpec.from_hf_config({**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ModelConfigError, match="need a mixture-of-experts model; Qwen3ForCausalLM is dense"):
        dense.check_layout(1, 1, 2)


@pytest.mark.parametrize("tp,pp,dp,ep,etp", [(1, 1, 4, 2, 1), (2, 1, 2, 2, 2), (2, 2, 2, 2, 1), (2, 1, 4, 4, 2),
                                             (1, 2, 4, 4, 1), (4, 1, 2, 2, 2)])
def test_the_expert_grid_is_megatrons(tp, pp, dp, ep, etp):
    """Every expert group equals the one megatron's RankGenerator makes (parallel_state's expert grid)."""
    from megatron.core.parallel_state import RankGenerator

    layout = ParallelLayout(tp, pp, dp, ep, etp)
    generator = RankGenerator(tp=etp, ep=ep, dp=layout.edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp", rank_offset=0)

    def same(ours, token):
        assert sorted(map(sorted, ours)) == sorted(map(sorted, generator.get_ranks(token))), token

    same(layout.expert_tp_groups(), "tp")
    same(layout.expert_parallel_groups(), "ep")
    same(layout.expert_dp_groups(), "dp")
    same(layout.expert_tp_ep_groups(), "tp-ep")
    same(layout.expert_model_parallel_groups(), "tp-ep-pp")
    for rank in range(layout.world_size):  # the expert grid folds over each stage's own ranks
        coordinate = layout.expert_coordinate(rank)
        assert coordinate.pp_rank == layout.coordinate(rank).pp_rank
        assert layout.expert_rank_of(*coordinate) == rank


def test_the_expert_split_must_fit_a_stage():
    with pytest.raises(ValueError, match=r"expert_parallel 4 x expert_tensor_parallel 2 = 8 does not divide the 4 "
                                         r"ranks of a pipeline stage .* EP sizes that fit with ETP 2: \[1, 2\]"):
        ParallelLayout(2, 1, 2, 4)
    assert str(ParallelLayout(2, 1, 2, 2, 1)) == "TP2xPP1xDP2xEP2xETP1"
    with pytest.raises(ValueError, match="moe_aux_loss_coeff must be a number >= 0"):
        EngineConfig(moe_aux_loss_coeff=-1)


def test_each_rank_holds_its_experts_by_global_name():
    spec = ModelSpec.from_hf_config(QWEN2_MOE)
    held = [p for p in stage_params(spec, 2, 2, 1, ExpertShard(ep=2, ep_rank=1, etp=1)) if p.expert is not None]
    assert {p.expert for p in held} == {2, 3} and {p.layer for p in held} == {2, 3}
    fc1 = lookup("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", spec, 1, 2, 2, ExpertShard(2, 1, 1))
    assert fc1.hf_names == ("model.layers.3.mlp.experts.2.gate_proj.weight", "model.layers.3.mlp.experts.2.up_proj.weight")
    assert fc1.shape == (64, 64)  # whole (ETP 1), though the dense TP is 2
    grouped = lookup("decoder.layers.1.mlp.experts.linear_fc1.weight0", spec, 1, 2, 2, ExpertShard(2, 1, 1))
    assert grouped.hf_names == fc1.hf_names  # transformer-engine's grouped name for the same expert
    shared = lookup("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", spec, 0, 2, 2)
    assert shared.shape == (48, 64) and shared.expert is None  # the shared expert splits over TP
    with pytest.raises(KeyError, match="an expert-parallel rank of 2 holds 2 of the 4 experts"):
        lookup("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight", spec, 0, 2, 1, ExpertShard(2, 0))


def test_bad_expert_layouts_and_rl_with_experts_are_refused_before_launch(tmp_path):
    spec = ModelSpec.from_hf_config(QWEN3_MOE)
    with pytest.raises(ConfigError, match=r"actor: expert_parallel 3 does not divide the 8 experts"):
        check_sft_config(load_sft_config(EXAMPLES / "sft_tiny.yaml", ["actor.engine.expert_parallel=3"]), spec)
    with pytest.raises(ConfigError, match=r"actor: expert_parallel 8 x expert_tensor_parallel 2 = 16 does not divide "
                                          r"the 2 ranks of a pipeline stage .*EP sizes that fit with ETP 2: \[1\]"):
        check_sft_config(load_sft_config(EXAMPLES / "sft_tiny.yaml", ["actor.engine.expert_parallel=8"]), spec)
    rl = ["actor.engine.expert_parallel=2", "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1"]
    with pytest.raises(ConfigError, match="its generation engine must load the resharded experts, which rules out a "
                                          "megatron rollout at genTP2xPP1 .*tensor_parallel 1 only"):
        check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, "rollout.engine=megatron",
                                                              "rollout.tensor_parallel=2"]), spec)
    # A rollout on a pool of its own: the same engines (the cross-pool link carries the experts too).
    pool = ["trainer.launcher=ray", "trainer.placement={rollout: 2}"]
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, "rollout.engine=megatron", *pool]), spec)
    with pytest.raises(ConfigError, match="rules out a megatron rollout at genTP2xPP1"):
        check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, "rollout.engine=megatron", "rollout.tensor_parallel=2",
                                                              *pool]), spec)
    with pytest.raises(ConfigError, match=r"rollout: generation tensor_parallel=4 does not divide the experts' FFN"):
        check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, "rollout.tensor_parallel=4", "trainer.launcher=ray",
                                                              "trainer.placement={rollout: 4}"]),
                     ModelSpec.from_hf_config({**QWEN3_MOE, "moe_intermediate_size": 18, "num_key_value_heads": 4}))
    with pytest.raises(ConfigError, match=r"generation tensor_parallel=4 does not divide the experts' FFN hidden size 18; "
                                          r"valid sizes: \[1, 2, 3, 6, 9, 18\], or whole experts per rank"):
        check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, "rollout.tensor_parallel=4"]),
                     ModelSpec.from_hf_config({**QWEN3_MOE, "moe_intermediate_size": 18, "num_key_value_heads": 4}))
    # vLLM at any generation TP (experts cut across it, or whole per rank), megatron's engine at TP1.
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, "rollout.engine=megatron"]), spec)
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, "rollout.tensor_parallel=2"]), spec)
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, "rollout.tensor_parallel=4", "rollout.expert_parallel=true"]),
                 ModelSpec.from_hf_config({**QWEN3_MOE, "num_key_value_heads": 4}))


def test_vllm_expert_parallelism_is_refused_on_the_cpu_path():
    """vLLM's CPU fused-experts kernel crashes under expert parallelism (with its own loading too): refused
    before an engine is built, naming what works; a dense model, TP1 and cut experts pass."""
    from hybridengine.reshard.plan import GenerationLayout
    from workers.rollout.vllm_engine import check_vllm_expert_parallel

    spec = ModelSpec.from_hf_config(QWEN3_MOE)
    with pytest.raises(ValueError, match=r"crashes .* expert parallelism \(rollout.expert_parallel at genTP2xPP1xEP\);"
                                         r" on CPU cut the experts"):
        check_vllm_expert_parallel(spec, GenerationLayout(2, 1, True))
    check_vllm_expert_parallel(spec, GenerationLayout(2, 1, False))
    check_vllm_expert_parallel(spec, GenerationLayout(1, 1, True))
    check_vllm_expert_parallel(ModelSpec.from_hf_config({**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]}),
                               GenerationLayout(2, 1, True))



def test_router_replay_settings_are_checked_before_launch():
    """algorithm.router_replay: a known mode, a mixture of experts, a rollout that reports its routes; every
    problem named at once. The rollout is told to report them by the mode alone."""
    from controller.rl.role_assembly import _returning_routes
    from workers.role_spec import RoleSpec
    from workers.rollout import Rollout, RolloutConfig

    spec = ModelSpec.from_hf_config(QWEN3_MOE)
    rl = ["actor.engine.expert_parallel=2", "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1",
          "rollout.engine=megatron"]
    for mode, engine in (("measure", "megatron"), ("rollout", "vllm")):
        check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, f"rollout.engine={engine}",
                                                              f"algorithm.router_replay={mode}"]), spec)
    with pytest.raises(ConfigError, match=r"algorithm.router_replay 'always' is not one of \('off', 'measure', 'rollout'\)"):
        check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, "algorithm.router_replay=always"]), spec)
    dense = ModelSpec.from_hf_config({**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ConfigError) as refused:
        check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [
            "algorithm.router_replay=rollout", "actor.engine.recompute_granularity=full",
            "actor.engine.moe_capacity_factor=1.25"]), dense)
    for part in ("algorithm.router_replay rollout is for mixtures of experts; Qwen3ForCausalLM has no router",
                 "recompute_granularity 'full': the recomputed forward would route afresh",
                 "moe_capacity_factor 1.25: the capacity would drop replayed tokens"):
        assert part in str(refused.value)
    # measuring drops nothing it replays: a capacity is fine there
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rl, "algorithm.router_replay=measure",
                                                          "actor.engine.moe_capacity_factor=1.25"]), spec)
    for config in ({"engine": "megatron"}, RolloutConfig(engine="megatron")):
        spec_in = RoleSpec(Rollout, {"model_path": "m", "config": config})
        out = _returning_routes(spec_in).kwargs["config"]
        assert (out["return_routed_experts"] if isinstance(out, dict) else out.return_routed_experts) is True
        typed = config if isinstance(config, RolloutConfig) else RolloutConfig(**config)  # (a RoleSpec types a dict)
        assert spec_in.kwargs["config"] == typed  # the user's spec untouched


def test_the_actor_alone_sees_the_rollout_routes_under_the_key_of_the_mode():
    import torch

    from controller.rl.routes import routes_for_actor, without_routes
    from workers import DataProto
    from workers.megatron.routing_replay import ROLLOUT_ROUTES, ROUTED_EXPERTS

    routes = torch.randint(0, 8, (2, 5, 2, 2), dtype=torch.int16)
    batch = DataProto({"input_ids": torch.zeros(2, 5, dtype=torch.long), ROLLOUT_ROUTES: routes})
    assert ROLLOUT_ROUTES not in routes_for_actor(batch, "off").batch
    assert routes_for_actor(batch, "measure").batch[ROLLOUT_ROUTES] is routes
    replayed = routes_for_actor(batch, "rollout").batch
    assert replayed[ROUTED_EXPERTS] is routes and ROLLOUT_ROUTES not in replayed
    for mode in ("measure", "rollout"):
        assert set(without_routes(routes_for_actor(batch, mode)).batch) == {"input_ids"}
    dense = DataProto({"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    assert routes_for_actor(dense, "rollout") is dense and without_routes(dense) is dense


def test_generation_expert_ids_become_training_ids_through_the_placement():
    import torch

    from workers.rollout.route_capture import to_training_ids

    routes = torch.tensor([[[3, 0]], [[1, 2]]])  # [positions, layers, k], generation ids
    placement = (2, 3, 0, 1)  # generation expert j is training expert placement[j]
    assert to_training_ids(routes, placement).tolist() == [[[1, 2]], [[0, 3]]]  # (3, 0) -> (1, 2); (1, 2) -> (3, 0)
    assert to_training_ids(routes, None).tolist() == [[[0, 3]], [[1, 2]]]  # ascending along k
    assert to_training_ids(routes, None).dtype == torch.int16
