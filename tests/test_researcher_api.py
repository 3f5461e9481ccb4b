"""The pieces of the design documents' researcher API, without a process group: the rollout schema, the
user's KL term, the schedules at a step, the device_map="auto" rule, keywords refused where written."""

import math

import pytest
import torch

from controller.rl.step_metrics import kl_metrics, phase_lines
from workers.actor import PPOActorConfig
from workers.data_proto import DataProto
from workers.data_schema import ROLLOUT_FIELDS, DataSchema
from workers.keywords import check_constructor, keyword_checked
from workers.policy_losses import LossNormalizer, agg_loss
from workers.role_spec import RoleSpec
from workers.user_kl import PolicyOutputs, UserKLTerm, check_kl_loss_fn


def test_keyword_form_of_dataproto_declares_a_schema_checked_against_the_rollout():
    proto = DataProto(input_ids="input_ids", attention_mask="attention_mask", sequences="sequences", logprobs="logprobs")
    assert isinstance(proto, DataSchema)
    assert proto.resolved() == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                "sequences": "input_ids", "logprobs": "rollout_log_probs"}
    proto.check(ROLLOUT_FIELDS)
    with pytest.raises(ValueError, match=r"rollout_proto declares values='values', which the rollout does not produce; "
                                         r"it produces \['attention_mask', 'input_ids'"):
        DataProto(values="values", input_ids="input_ids").check(ROLLOUT_FIELDS)
    with pytest.raises(TypeError, match="each value must be a field name"):
        DataProto(logprobs=3)
    batch = DataProto({"input_ids": torch.ones(2, 3), "rollout_log_probs": torch.zeros(2, 1)})
    assert len(batch) == 2 and set(proto.view(DataProto({k: torch.zeros(2, 1) for k in ROLLOUT_FIELDS}))) == set(
        proto.fields)


def _kl_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    log_prob = (torch.randn(3, 4, generator=g) - 1).requires_grad_()
    ref = torch.randn(3, 4, generator=g) - 1
    ref[mask == 0] = float("nan")  # padding is never read
    return log_prob, ref, mask


def test_the_documents_kl_function_sees_logprobs_and_adds_up_over_micro_batches():
    """dynamic_kl_loss of the first document: beta * mean(actor.logprobs - ref.logprobs) over valid tokens."""
    def dynamic_kl_loss(actor_outputs, ref_outputs, step, total_steps=1000):
        from hybridflow.utils import linear_schedule

        current_beta = linear_schedule(0.2, 0.02, step, total_steps)
        kl_div = torch.mean(actor_outputs.logprobs - ref_outputs.logprobs)
        return current_beta * kl_div

    log_prob, ref, mask = _kl_inputs()
    valid = mask.bool()
    expected_kl = (log_prob.detach()[valid] - ref[valid]).mean()
    beta = 0.2 + (0.02 - 0.2) * 500 / 1000
    norm = LossNormalizer(tokens=float(mask.sum()), sequences=3.0)
    term = UserKLTerm(dynamic_kl_loss, step=500)
    whole, stats = term(log_prob, ref, mask, "token-mean", norm)
    torch.testing.assert_close(whole, beta * expected_kl)
    torch.testing.assert_close(stats["kl_div"], expected_kl)
    torch.testing.assert_close(stats["kl_unit_loss"], torch.tensor(beta))  # linear in the KL: its coefficient
    # Two micro-batches' shares add up to the whole, gradient included.
    whole.backward()
    grad = log_prob.grad.clone()
    log_prob.grad = None
    parts = sum(term(log_prob[i], ref[i], mask[i], "token-mean", norm)[0] for i in (slice(0, 1), slice(1, 3)))
    torch.testing.assert_close(parts, whole.detach())
    parts.backward()
    torch.testing.assert_close(log_prob.grad, grad)
    assert (grad[mask == 0] == 0).all()


def test_kl_function_returning_per_token_terms_is_aggregated_like_the_policy_loss():
    log_prob, ref, mask = _kl_inputs(1)
    norm = LossNormalizer(tokens=float(mask.sum()), sequences=3.0)
    per_token = UserKLTerm(lambda a, r, step: 0.1 * (a.token_logprobs - r.token_logprobs))
    flat = UserKLTerm(lambda a, r, step: 0.1 * (a.logprobs - r.logprobs))
    expected = agg_loss(0.1 * (log_prob - torch.nan_to_num(ref)), mask, "seq-mean-token-mean", norm)
    for term in (per_token, flat):
        loss, _ = term(log_prob, ref, mask, "seq-mean-token-mean", norm)
        torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match=r"kl_loss_fn returned shape \(2,\); valid: a scalar, \[9\]"):
        UserKLTerm(lambda a, r, step: torch.zeros(2))(log_prob, ref, mask, "token-mean", norm)
    with pytest.raises(TypeError, match="must accept \\(actor_outputs, ref_outputs, step\\)"):
        check_kl_loss_fn(lambda a, r: 0)
    out = PolicyOutputs.of(ref, mask)
    assert out.logprobs.shape == (9,) and torch.isfinite(out.token_logprobs).all()


def test_kl_and_beta_metrics():
    ppo = PPOActorConfig()
    user = {"actor/kl_div": 0.02, "actor/kl_loss": 0.004, "actor/kl_unit_loss": 0.2}
    assert kl_metrics(user, user_fn=True, ppo=ppo, reward_beta=None) == {"kl_div": 0.02, "beta": pytest.approx(0.2)}
    first = {"actor/kl_div": 0.0, "actor/kl_loss": 0.0, "actor/kl_unit_loss": 0.2}  # actor == reference
    assert kl_metrics(first, user_fn=True, ppo=ppo, reward_beta=None)["beta"] == 0.2
    assert kl_metrics({"actor/kl_div": 0.5}, False, PPOActorConfig(use_kl_loss=True, kl_loss_coef=0.01), None) == {
        "kl_div": 0.5, "beta": 0.01}
    assert kl_metrics({"actor/kl_div": 0.5}, False, ppo, reward_beta=0.05) == {"kl_div": 0.5, "beta": 0.05}
    assert kl_metrics({}, False, ppo, None) == {}
    lines = phase_lines({"response_length/mean": 5.0, "response_length/max": 8, "timing_s/rollout": 1.0,
                         "timing_s/reward": 0.5, "critic/score/mean": 0.25, "actor/pg_loss": -0.1, "kl_div": 0.02,
                         "beta": 0.2, "timing_s/update_actor": 2.0}, 64)
    assert lines[0] == "rollout: generated 64 sequences (response length mean 5.0, max 8) in 1.00 s"
    assert lines[-1] == "update: pg_loss=-0.100, kl_div=0.020, beta=0.200 in 2.00 s"


def test_schedules_at_a_step():
    from hybridflow.utils import cosine_schedule, exponential_decay, linear_schedule

    assert linear_schedule(0.2, 0.02, 0, 1000) == 0.2
    assert linear_schedule(0.2, 0.02, 500, 1000) == pytest.approx(0.11)
    assert linear_schedule(0.2, 0.02, 5000, 1000) == pytest.approx(0.02)
    assert exponential_decay(1.0, 0.5, 2, 1) == 0.25
    assert cosine_schedule(1.0, 0.0, 50, 100) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="total_steps"):
        linear_schedule(0.2, 0.02, 1, 0)


def test_the_trainer_writes_device_map_auto_layouts_into_its_config_before_the_checks(tmp_path, monkeypatch):
    """At build the auto roles' layouts, the planner's (controller.planner.device_map), go into the typed config
    (the reference made from the actor's model included), so check_config and the workers see the layout that
    will run; a role laid out by hand keeps its layout."""
    import controller.rl.job_assembly as trainer_module  # where the job is laid out
    from controller.config import ConfigError
    from controller.models.builtin import resolve_model_path
    from controller.planner.device_map import auto_layouts, job_cluster
    from controller.rl.trainer import RLTrainer
    from hybridflow import Actor, Critic, arithmetic_prompts

    model = resolve_model_path("builtin:tiny-arithmetic", tmp_path)
    monkeypatch.setenv("HYBRIDFLOW_CALIBRATION", str(tmp_path / "none.json"))  # this machine uncalibrated: nominal
    monkeypatch.setattr(trainer_module, "device_memory_bytes", lambda: 4 * 64 * 2**20)  # 64 MiB a process

    def job(actor_layout: dict):
        return RLTrainer(actor=Actor.from_pretrained(model, ppo={"use_kl_loss": True, "ppo_mini_batch_size": 2},
                                                     **actor_layout),
                         critic=Critic.from_pretrained(model, device_map="auto", critic={"ppo_mini_batch_size": 2}),
                         train_data=arithmetic_prompts(8, seed=0), batch_size=2, processes=4, reward_fn="arithmetic_shaped")

    auto = job({"device_map": "auto"})
    # As written (TP 1 on 4 processes: DP 4) a mini-batch of 2 cannot split; laid out (DP 2 at most) it can.
    with pytest.raises(ConfigError, match="ppo_mini_batch_size 2 does not divide over 4 data-parallel ranks"):
        auto.check()
    cluster, efficiency = job_cluster(1, 4, 4, 4 * 64 * 2**20)
    expected = auto_layouts(auto.placed_config(), {"actor", "critic", "ref_policy"}, cluster, efficiency,
                            flash_attention=False)
    auto.lay_out()
    config = auto.config
    for role, section in (("actor", config.actor), ("critic", config.critic), ("ref_policy", config.ref_policy)):
        layout = (section.engine.tensor_parallel, section.engine.pipeline_parallel)
        assert layout == expected[role][:2] and expected[role][2] == section.engine.context_parallel == 1, (role, layout)
        assert role == "ref_policy" or layout[0] * layout[1] >= 2  # a trained role's DP splits its mini-batch of 2
        assert section.device_map is None
    assert auto.specs["ref_policy"].kwargs["engine"].tensor_parallel == config.ref_policy.engine.tensor_parallel
    auto.check()

    by_hand = job({"device_map": "auto", "tensor_parallel": 2, "pipeline_parallel": 2})
    by_hand.lay_out()
    assert (by_hand.config.actor.engine.tensor_parallel, by_hand.config.actor.engine.pipeline_parallel) == (2, 2)
    assert by_hand.config.critic.engine.tensor_parallel * by_hand.config.critic.engine.pipeline_parallel >= 2
    by_hand.check()
    with pytest.raises(ValueError, match="device_map 'balanced' is not supported; valid: 'auto'"):
        RoleSpec(object, {}, device_map="balanced")


def test_keywords_are_refused_where_written():
    from workers.actor import Actor

    with pytest.raises(TypeError, match=r"Actor: unknown keyword 'optimizer' \(did you mean 'optim'\?\); valid keywords: "
                                        r"\['engine', 'freeze_vision_tower', 'lora', 'model_path', 'optim', 'ppo'\]"):
        check_constructor(Actor, {"model_path": "m", "optimizer": {}})
    with pytest.raises(TypeError, match=r"Actor\(optim=...\): unknown keyword 'learning_rate'; valid keywords: "
                                        r"\['adam_beta1'"):
        check_constructor(Actor, {"model_path": "m", "optim": {"learning_rate": 1e-3}})
    with pytest.raises(ValueError, match=r"Actor\(ppo=...\): .*ppo_epochs \(0\) must be >= 1"):
        check_constructor(Actor, {"model_path": "m", "ppo": {"ppo_epochs": 0}})

    @keyword_checked
    def f(a, *, beta=1.0):
        return a * beta

    assert f(2, beta=3.0) == 6.0
    with pytest.raises(TypeError, match=r"f: unknown keyword 'betta' \(did you mean 'beta'\?\)"):
        f(2, betta=3.0)
    assert not math.isnan(0.0)


def test_a_role_spec_carries_its_sections_typed_and_the_worker_takes_them_as_they_are():
    """A section given as a dict is built into its dataclass where the RoleSpec is made (the values checked
    there, naming the section); one given typed is kept as it is; with_parallelism keeps it typed; and no
    worker module re-types a section (no as_config, no from_value in workers/)."""
    import re

    from conftest import ROOT
    from workers.actor import Actor
    from workers.megatron.config import EngineConfig, OptimConfig
    from workers.megatron.lora import LoRAConfig
    from workers.rollout import Rollout
    from workers.rollout.config import RolloutConfig

    spec = RoleSpec(Actor, {"model_path": "m", "engine": {"tensor_parallel": 2}, "optim": OptimConfig(lr=3e-4),
                            "lora": {"rank": 4}})
    assert spec.kwargs["engine"] == EngineConfig(tensor_parallel=2) and spec.kwargs["optim"] == OptimConfig(lr=3e-4)
    assert spec.kwargs["lora"] == LoRAConfig(rank=4)
    wider = spec.with_parallelism(pipeline_parallel=2)
    assert wider.kwargs["engine"] == EngineConfig(tensor_parallel=2, pipeline_parallel=2) and wider.explicit_parallelism
    assert RoleSpec(Rollout, {"model_path": "m", "config": {"engine": "megatron"}}).kwargs["config"] == \
        RolloutConfig(engine="megatron")
    with pytest.raises(ValueError, match=r"RoleSpec\(Rollout\)\(config=...\): invalid rollout config: engine 'nope'"):
        RoleSpec(Rollout, {"model_path": "m", "config": {"engine": "nope"}})
    retyped = [f"{path.relative_to(ROOT)}:{n}" for path in (ROOT / "workers").rglob("*.py")
               for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\b(as_config|from_value)\(", line)]
    assert retyped == []


def test_every_front_door_refuses_a_wrong_keyword_before_anything_starts(tmp_path):
    """One test per front door: the roles' from_pretrained, RLTrainer, the config tree, the DataFlow decorators."""
    from controller.config import ConfigError, load_config
    from controller.models.builtin import resolve_model_path
    from controller.dataflow.declarations import register_placement
    from controller.rl.trainer import RLTrainer
    from hybridflow import Actor, Critic, ReferencePolicy, RewardModel, Rollout, arithmetic_prompts

    model = resolve_model_path("builtin:tiny-arithmetic", tmp_path)
    with pytest.raises(TypeError, match=r"Actor.from_pretrained: unknown keyword 'lr' \(it is a field of optim: "
                                        r"optim=\{'lr': ...\}\); valid keywords: \['engine', 'freeze_vision_tower', "
                                        r"'lora', 'model_path', 'optim', 'ppo'\]"):
        Actor.from_pretrained(model, device_map="auto", lr=1e-3)
    with pytest.raises(TypeError, match=r"Critic.from_pretrained\(critic=...\): unknown keyword 'ppo_epoch' \(did you "
                                        r"mean 'ppo_epochs'\?\)"):
        Critic.from_pretrained(model, critic={"ppo_epoch": 2})
    with pytest.raises(TypeError, match=r"ReferencePolicy.from_pretrained\(engine=...\): unknown keyword 'precison' "
                                        r"\(did you mean 'precision'\?\)"):
        ReferencePolicy.from_pretrained(model, engine={"precison": "fp32"})
    with pytest.raises(TypeError, match=r"Rollout.from_pretrained\(config=...\): unknown keyword 'max_new_token'"):
        Rollout.from_pretrained(model, max_new_token=8)
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['dtype'\]"):
        RewardModel.from_pretrained(model, dtype="bf16")
    with pytest.raises(ValueError, match="device_map 'balanced' is not supported"):
        Actor.from_pretrained(model, device_map="balanced")
    with pytest.raises(TypeError, match=r"RLTrainer: unknown keyword 'learning_rate'; valid keywords: \['actor'"):
        RLTrainer(actor=Actor.from_pretrained(model), train_data=arithmetic_prompts(8, seed=0), batch_size=4,
                  reward_fn="arithmetic_shaped", learning_rate=1e-3)
    with pytest.raises(TypeError, match=r"RLTrainer\(critic=...\) takes a declared role, e.g. "
                                        r"critic=Critic.from_pretrained\(path\); got str"):
        RLTrainer(actor=Actor.from_pretrained(model), critic=model, train_data=arithmetic_prompts(8, seed=0),
                  batch_size=4, reward_fn="arithmetic_shaped")
    config = tmp_path / "job.yaml"
    config.write_text("trainer: {total_step: 3}\n")
    with pytest.raises(ConfigError, match=r"trainer: unknown key\(s\) \['total_step'\]; valid keys: \["):
        load_config(str(config))
    # RLTrainer(config): the objects beside the config are named too, and the config must be the typed tree
    typed = load_config(None, [f"model_path={model}"])
    with pytest.raises(TypeError, match=r"RLTrainer\(config, ...\): unknown keyword 'train_dataset' \(did you mean "
                                        r"'train_data'\?\); valid keywords: \['algorithm', 'logger', 'pool', "
                                        r"'train_data', 'val_data'\]"):
        RLTrainer(typed, train_dataset=arithmetic_prompts(8, seed=0))
    with pytest.raises(TypeError, match=r"RLTrainer\(config\): config must be an RLConfig .* got dict"):
        RLTrainer({"model_path": model})
    with pytest.raises(TypeError, match=r"missing: \['train_data', 'batch_size'\]"):
        RLTrainer(actor=Actor.from_pretrained(model))
    with pytest.raises(ConfigError, match=r"algorithm: unknown key\(s\) \['estimator'\]; valid keys: \["):
        RLTrainer(actor=Actor.from_pretrained(model), train_data=arithmetic_prompts(8, seed=0), batch_size=4,
                  reward_fn="arithmetic_shaped", algorithm={"name": "grpo", "estimator": "grpo"})
    with pytest.raises(ConfigError, match=r"data.batch_size: expected an integer, got '4'"):
        RLTrainer(actor=Actor.from_pretrained(model), train_data=arithmetic_prompts(8, seed=0), batch_size="4",
                  reward_fn="arithmetic_shaped", algorithm="grpo")
    with pytest.raises(ConfigError, match=r"trainer.val_before_train: expected true or false, got 1"):
        RLTrainer(actor=Actor.from_pretrained(model), train_data=arithmetic_prompts(8, seed=0), batch_size=4,
                  reward_fn="arithmetic_shaped", algorithm="grpo", val_before_train=1)
    with pytest.raises(ConfigError, match=r"critic=... is given, but grpo estimates advantages without one"):
        RLTrainer(actor=Actor.from_pretrained(model), critic=Critic.from_pretrained(model), algorithm="grpo",
                  train_data=arithmetic_prompts(8, seed=0), batch_size=4, reward_fn="arithmetic_shaped")
    # A worker group built by hand: its worker's keywords are checked in the driver, before any worker is made.
    from types import SimpleNamespace

    from controller.runtime.worker_group import WorkerGroup

    with pytest.raises(TypeError, match=r"Actor: unknown keyword 'engin' \(did you mean 'engine'\?\)"):
        WorkerGroup(SimpleNamespace(world_size=1), Actor, kwargs={"model_path": model, "engin": {}})
    with pytest.raises(TypeError, match=r"Actor\(optim=...\): unknown keyword 'learning_rate'"):
        WorkerGroup(SimpleNamespace(world_size=1), Actor, kwargs={"model_path": model, "optim": {"learning_rate": 1}})
    with pytest.raises(ValueError, match=r"register_placement\('actor'\): devices must be a non-empty list"):
        register_placement("actor", devices="cuda:0")


def test_data_files_given_means_the_files_are_the_data(tmp_path):
    from controller.config import ConfigError, DataConfig, check_config, load_config
    from controller.sft.config import SFTDataConfig

    assert DataConfig(train_files=("rows.parquet",)).task == "files"
    assert DataConfig().task == "arithmetic" and SFTDataConfig().task == "arithmetic"
    assert SFTDataConfig(train_files=("rows.jsonl",)).task == "files"
    # Said explicitly, the built-in task with files is still a contradiction, named before launch.
    with pytest.raises(ConfigError, match="data.train_files / val_files are set but data.task is 'arithmetic'"):
        check_config(load_config("examples/ppo_tiny.yaml", ["data.train_files=[x.parquet]"]))


def test_a_job_config_takes_any_hf_reward_classifier(tmp_path):
    """reward.model_path may name a DeBERTa classifier (the transformers worker scores it); a causal LM there is
    refused before launch, naming the path."""
    from controller.config import ConfigError, load_config
    from controller.models.builtin import resolve_model_path
    from controller.jobs.train_job import prepare_job

    rm = resolve_model_path("builtin:tiny-deberta-reward", tmp_path)
    policy = resolve_model_path("builtin:tiny-arithmetic", tmp_path)
    overrides = [f"trainer.run_dir={tmp_path / 'run'}", f"model_path={policy}", "reward.fn=null",
                 "data.train_size=32", "data.val_size=0"]
    model, prompts = prepare_job(load_config("examples/ppo_tiny.yaml", [*overrides, f"reward.model_path={rm}"]))
    assert model == policy and len(prompts.train) == 32
    with pytest.raises(ConfigError, match=r"reward.model_path: a reward model must be a \*ForSequenceClassification "
                                          r"checkpoint \(one-label score head\); .* is a LlamaForCausalLM"):
        prepare_job(load_config("examples/ppo_tiny.yaml", [*overrides, f"reward.model_path={policy}"]))


def test_a_critic_on_a_causal_lm_gets_its_body_and_a_new_value_head(tmp_path):
    """Critic.from_pretrained(<causal LM>): the trainer writes the LM's body with a bias-free value head drawn from
    N(0, initializer_range^2), as verl's megatron critic starts; a sequence-classification checkpoint is kept."""
    from safetensors.torch import load_file

    from controller.models.builtin import resolve_model_path, value_model_from_policy
    from controller.rl.role_defaults import critic_from_causal_lm
    from hybridflow import Critic

    policy = resolve_model_path("builtin:tiny-arithmetic", tmp_path)
    spec = critic_from_causal_lm(Critic.from_pretrained(policy, device_map="auto"), tmp_path / "run")
    value_path = spec.kwargs["model_path"]
    assert value_path == str(tmp_path / "run" / "critic-init") and spec.device_map == "auto"
    lm, value = load_file(f"{policy}/model.safetensors"), load_file(f"{value_path}/model.safetensors")
    body = [k for k in lm if k != "lm_head.weight"]
    assert body and all(torch.equal(lm[k], value[k]) for k in body)
    head = value["score.weight"]
    assert head.shape == (1, 128) and "score.bias" not in value
    assert abs(float(head.std()) - 0.05) < 0.015  # the tiny model's initializer_range
    again = value_model_from_policy(policy, tmp_path / "again", head_init="normal")
    assert torch.equal(load_file(f"{again}/model.safetensors")["score.weight"], head)  # seeded
    assert critic_from_causal_lm(spec, tmp_path / "other") == spec  # a value model stays as it is
    with pytest.raises(ValueError, match=r"head_init 'xavier' is not one of \('zeros', 'normal'\)"):
        value_model_from_policy(policy, tmp_path / "x", head_init="xavier")


def test_the_rollout_schema_is_checked_before_launch(tmp_path):
    from controller.models.builtin import resolve_model_path
    from controller.rl.trainer import RLTrainer
    from hybridflow import Actor, arithmetic_prompts

    model = resolve_model_path("builtin:tiny-arithmetic", tmp_path)
    with pytest.raises(ValueError, match=r"rollout_proto declares rewards='token_level_rewards', which the rollout does "
                                         r"not produce; it produces \['attention_mask', 'input_ids', 'position_ids', "
                                         r"'prompts', 'response_mask', 'responses', 'rollout_log_probs'\]"):
        RLTrainer(actor=Actor.from_pretrained(model), train_data=arithmetic_prompts(8, seed=0), batch_size=4,
                  reward_fn="arithmetic_shaped", rollout_proto=DataProto(logprobs="logprobs",
                                                                         rewards="token_level_rewards"))


def test_an_algorithms_hooks_see_a_step_context_not_the_trainer():
    """The hooks get the step's settings and the calls they may make; the trainer's pools, specs and checkpoints
    are out of reach."""
    from types import SimpleNamespace

    from controller.algorithms import StepContext

    trainer = SimpleNamespace(global_step=3, mode="sync", ppo=PPOActorConfig(), max_response_length=8, pad_token_id=0,
                              loader="loader", groups={"actor": "group"}, generate=len, generate_and_score=len,
                              score=len, pools={"default": "pool"}, specs={})
    ctx = StepContext.of(trainer)
    assert (ctx.step, ctx.mode, ctx.max_response_length, ctx.groups["actor"]) == (3, "sync", 8, "group")
    assert not hasattr(ctx, "pools") and not hasattr(ctx, "specs") and not hasattr(ctx, "save_checkpoint")
    with pytest.raises(TypeError):
        ctx.groups["critic"] = "another"  # read-only


def test_the_keyword_builder_and_a_config_give_the_same_run(tmp_path):
    """RLTrainer(actor=..., ...) fills the typed tree; RLTrainer(config) from the same values as YAML is the
    same job: equal configs, and metrics equal to 1e-6 over 3 steps (PPO with a critic made from the LM, a
    KL loss term and a function reward)."""
    import yaml

    from controller.config import config_from_dict
    from controller.models.builtin import resolve_model_path
    from controller.rl.trainer import RLTrainer
    from controller.rl.trainer_builder import config_from_keywords
    from hybridflow import Actor, Critic, Rollout, arithmetic_prompts

    model = resolve_model_path("builtin:tiny-arithmetic", tmp_path)
    prompts = arithmetic_prompts(32, seed=1)
    keywords = dict(
        actor=Actor.from_pretrained(model, micro_batch_size=4, ppo={"ppo_mini_batch_size": 8, "use_kl_loss": True}),
        critic=Critic.from_pretrained(model, micro_batch_size=4, critic={"ppo_mini_batch_size": 8}),
        rollout=Rollout.from_pretrained(model, engine="megatron", max_prompt_length=8,
                                        sampling={"max_new_tokens": 4, "n": 2}),
        reward_fn="arithmetic_shaped", algorithm="ppo", lr=2e-3, train_data=prompts, batch_size=4, processes=1,
        seed=3, backend="ray")
    config = config_from_dict(yaml.safe_load(f"""
model_path: {model}
actor: {{engine: {{micro_batch_size: 4}}, optim: {{lr: 2.0e-3}}}}
ppo: {{ppo_mini_batch_size: 8, use_kl_loss: true}}
critic: {{model_path: {model}, engine: {{micro_batch_size: 4}}, optim: {{lr: 2.0e-3}}}}
critic_ppo: {{ppo_mini_batch_size: 8, value_head_init: normal}}
rollout: {{engine: megatron, max_prompt_length: 8, sampling: {{max_new_tokens: 4, n: 2}}}}
reward: {{fn: arithmetic_shaped}}
algorithm: {{name: ppo}}
data: {{batch_size: 4}}
trainer: {{nproc: 1, launcher: ray, seed: 3, run_dir: null}}
"""))
    assert config_from_keywords(**keywords)[0] == config

    def three_steps(trainer):
        try:
            return [trainer.step() for _ in range(3)]
        finally:
            trainer.shutdown()

    built, typed = three_steps(RLTrainer(**keywords)), three_steps(RLTrainer(config, train_data=prompts))
    for a, b in zip(built, typed):
        keys = sorted(k for k in a if not k.startswith(("timing_s/", "perf/")) and k != "rollout/tokens_per_s")
        assert keys == sorted(k for k in b if not k.startswith(("timing_s/", "perf/")) and k != "rollout/tokens_per_s")
        assert "critic/vf_loss" in keys and "actor/kl_loss" in keys
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-6, rel=0), key


def test_a_config_without_train_data_gets_the_clis_prompt_checks(tmp_path):
    """RLTrainer(config) loads config.data's prompts itself, with the checks hybridflow train makes
    (controller.rl.job_prompts): here a data_source no scorer knows, under reward.fn auto."""
    import json

    from controller.config import ConfigError, load_config
    from controller.models.builtin import resolve_model_path
    from controller.rl.trainer import RLTrainer

    model = resolve_model_path("builtin:tiny-arithmetic", tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "data_source": "my_source",
                                        "reward_model": {"ground_truth": str(i + 1)}}) + "\n" for i in range(4)))
    config = load_config(None, [f"model_path={model}", f"data.train_files={rows}", "reward.fn=auto",
                                "data.batch_size=2", "algorithm.name=grpo", "rollout.sampling.n=2", "trainer.launcher=ray"])
    with pytest.raises(ConfigError, match=r"reward.fn is 'auto' \(score by data_source\), but no reward function is "
                                          r"known for data_source 'my_source'"):
        RLTrainer(config)
