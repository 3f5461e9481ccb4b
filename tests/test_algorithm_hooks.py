"""The algorithm objects' hooks with no process group: presets, the registry, ReMax, DAPO, Safe-RLHF.

``ScriptedTrainer`` stands in for the services a hook uses (generate, score, the prompt loader): it
answers each generation round with responses whose lengths and scores the test chose, so DAPO's
filtering, extra rounds, fill and overlong shaping are checked against counts worked out by hand.
"""

import sys
import textwrap

import numpy as np
import pytest
import torch

from controller.algorithms import (
    ALGORITHMS,
    DAPO,
    RLAlgorithm,
    SafeRLHF,
    StepState,
    build_algorithm,
    combine_advantages,
    compute_advantages,
    informative_groups,
    overlong_penalty,
    register_algorithm,
    resolve_algorithm,
    resolve_rollout_correction,
)
from controller.algorithms.advantages import AdvantageInputs
from controller.config import AlgorithmConfig, ConfigError, RolloutCorrectionConfig, check_config, load_config
from conftest import ROOT
from workers.actor import PPOActorConfig
from workers.data_proto import DataProto
from workers.policy_losses import PolicyLossSpec

N = 2  # samples per prompt
MAX_NEW = 10


def rollout_batch(prompt_ids: list[int], scores: list[float], lengths: list[int], prompt_width: int = 3) -> DataProto:
    """A rollout batch as the rollout returns it: prompt-major rows, right-padded responses, scores on the last token."""
    rows = len(scores)
    mask = torch.zeros(rows, MAX_NEW, dtype=torch.long)
    token_scores = torch.zeros(rows, MAX_NEW)
    for r, (length, score) in enumerate(zip(lengths, scores)):
        mask[r, :length] = 1
        token_scores[r, length - 1] = score
    prompts = torch.ones(rows, prompt_width, dtype=torch.long)
    responses = torch.full((rows, MAX_NEW), 5) * mask
    attention = torch.cat([torch.ones_like(prompts), mask], dim=1)
    return DataProto({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention, "position_ids": attention.cumsum(-1) - 1, "response_mask": mask,
        "rollout_log_probs": torch.zeros(rows, MAX_NEW), "token_level_scores": token_scores,
        "scores": torch.tensor(scores),
    }, {"uid": np.asarray([f"p{p}" for p in prompt_ids for _ in range(N)], dtype=object)})


class ScriptedTrainer:
    """A hook's step context (controller.algorithms.StepContext) in miniature: generate_and_score answers round k
    with rounds[k]; the loader hands out prompt batches in order."""

    def __init__(self, rounds, ppo=None):
        self.rounds, self.calls, self.mode = rounds, [], "sync"
        self.max_response_length, self.pad_token_id = MAX_NEW, 0
        self.ppo = ppo or PPOActorConfig()
        self.loader = self

    def next_batch(self):
        return DataProto({"input_ids": torch.ones(2, 3, dtype=torch.long)})

    def generate_and_score(self, prompts, state, round_index=0):
        self.calls.append(round_index)
        return self.rounds[round_index]


def dapo(**settings) -> DAPO:
    return build_algorithm(AlgorithmConfig(name="dapo", **settings))


# ----------------------------------------------------------------- pure functions
def test_overlong_penalty_by_hand():
    # max 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10
    lengths = torch.tensor([3, 6, 7, 8, 10])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 10, 4, penalty_factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(lengths, 10, 0).tolist() == [0.0] * 5
    with pytest.raises(ValueError, match=r"overlong_buffer_len must be in \[0, max_length = 10\], got 11"):
        overlong_penalty(lengths, 10, 11)


def test_informative_groups():
    keep, drop = informative_groups(["a", "a", "b", "b", "c", "d", "d"], torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.0]))
    assert keep == ["a"] and drop == ["b", "c", "d"]  # c: a group of one has no spread


# ------------------------------------------------------------------------- DAPO
def test_dapo_filters_generates_more_and_cuts_the_surplus():
    # Each round: 2 prompts x 2 samples. Round 0: prompt 0 informative, prompt 1 all 1.0.
    # Round 1: prompts 2 and 3 both informative -> 3 kept groups for 2 wanted: the surplus is cut.
    rounds = [rollout_batch([0, 1], [1.0, 0.0, 1.0, 1.0], [2, 2, 2, 2]),
              rollout_batch([2, 3], [0.0, 1.0, 1.0, 0.0], [2, 2, 2, 2], prompt_width=5)]
    trainer, state = ScriptedTrainer(rounds), StepState(0, prompts=DataProto({"x": torch.zeros(2)}))
    out = dapo(overlong_buffer_len=0).after_scoring(trainer, state, rounds[0])
    assert trainer.calls == [1]
    assert list(out.non_tensor_batch["uid"]) == ["r0/p0", "r0/p0", "r1/p2", "r1/p2"]
    assert out.batch["scores"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out.batch["input_ids"].shape == (4, 5 + MAX_NEW)  # round 0's prompts left-padded to round 1's width
    assert out.batch["attention_mask"][0, :2].tolist() == [0, 0]
    assert state.metrics["dapo/filtered_groups"] == 1.0 and state.metrics["dapo/gen_batches"] == 2.0
    assert state.metrics["dapo/filled_groups"] == 0.0


def test_dapo_fills_with_dropped_groups_when_the_rounds_run_out():
    flat = rollout_batch([0, 1], [1.0, 1.0, 0.0, 0.0], [2, 2, 2, 2])
    trainer, state = ScriptedTrainer([flat, flat]), StepState(0, prompts=DataProto({"x": torch.zeros(2)}))
    out = dapo(overlong_buffer_len=0, max_gen_batches=2).after_scoring(trainer, state, flat)
    assert trainer.calls == [1] and len(out) == 4
    assert state.metrics["dapo/filtered_groups"] == 4.0 and state.metrics["dapo/filled_groups"] == 2.0
    # the fill keeps the step's size; its groups have equal scores, so GRPO gives them zero advantage
    adv, _ = compute_advantages("grpo", AdvantageInputs(out.batch["token_level_scores"], out.batch["response_mask"],
                                                        group_index=out.non_tensor_batch["uid"]))
    assert adv.abs().max() == 0.0


def test_dapo_overlong_shaping_on_the_last_token():
    batch = rollout_batch([0, 1], [1.0, 0.0, 1.0, 1.0], [3, 8, 9, 10])
    trainer, state = ScriptedTrainer([batch]), StepState(0, prompts=DataProto({"x": torch.zeros(2)}))
    out = dapo(dynamic_sampling=False, overlong_buffer_len=4).after_scoring(trainer, state, batch)
    # free up to 6 tokens: penalties 0, -0.5, -0.75, -1.0
    assert out.batch["scores"].tolist() == [1.0, -0.5, 0.25, 0.0]
    assert out.batch["token_level_scores"][1, 7].item() == -0.5 and out.batch["token_level_scores"][1, :7].abs().sum() == 0
    assert state.metrics["dapo/overlong_frac"] == 0.75
    assert state.metrics["dapo/overlong_penalty/mean"] == pytest.approx(-2.25 / 4)
    assert trainer.calls == []
    # the preset's buffer: 20% of max_new_tokens (10 -> 2 tokens)
    assert dapo().buffer_len(MAX_NEW) == 2


# ------------------------------------------------------------- presets and loss
@pytest.mark.parametrize("name, kind, low, high, agg", [
    ("ppo", "ppo", 0.2, 0.2, "token-mean"),
    ("dapo", "ppo", 0.2, 0.28, "token-mean"),
    ("gspo", "gspo", 3e-4, 4e-4, "seq-mean-token-mean"),
    ("gspo_token", "gspo_token", 3e-4, 4e-4, "seq-mean-token-mean"),
    ("dr_grpo", "ppo", 0.2, 0.2, "seq-mean-token-sum-norm"),
    ("cispo", "cispo", 1.0, 4.0, "token-mean"),
])
def test_presets_fill_what_the_user_left_unset(name, kind, low, high, agg):
    alg = build_algorithm(AlgorithmConfig(name=name))
    terms = alg.loss_terms(ScriptedTrainer([]), StepState(0), DataProto({}))
    assert terms.policy_loss == PolicyLossSpec(kind, low, high, 3.0, agg)
    assert terms.norm_length == MAX_NEW and not terms.rollout_correction.on
    # a value the user set wins over the preset
    user = ScriptedTrainer([], ppo=PPOActorConfig(clip_ratio_high=0.5, loss_agg_mode="token-mean"))
    terms = alg.loss_terms(user, StepState(0), DataProto({}))
    assert terms.policy_loss.clip_ratio_high == 0.5 and terms.policy_loss.agg_mode == "token-mean"
    assert terms.policy_loss.clip_ratio_low == low


def test_dr_grpo_keeps_the_group_std_out():
    rewards = torch.tensor([[1.0], [0.0], [3.0], [1.0]])
    mask = torch.ones(4, 1)
    batch = DataProto({"token_level_scores": rewards, "response_mask": mask}, {"uid": np.asarray(["a", "a", "b", "b"], dtype=object)})
    out = build_algorithm(AlgorithmConfig(name="dr_grpo")).advantages(None, StepState(0), batch)
    assert out.batch["advantages"].flatten().tolist() == [0.5, -0.5, 1.0, -1.0]
    grpo = build_algorithm(AlgorithmConfig(name="grpo")).advantages(None, StepState(0), batch)
    assert grpo.batch["advantages"][0].item() == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-6))  # std of (1, 0): sqrt(0.5)


def test_reinforce_plus_plus_baseline_by_name_uses_its_estimator_over_the_prompt_groups():
    # scores 1, 3, 0, 1 on the last real token; prompts a = rows 0, 2 and b = rows 1, 3 (the batch's uids)
    rewards = torch.tensor([[0.0, 1.0], [3.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    batch = DataProto({"token_level_scores": rewards, "response_mask": mask},
                      {"uid": np.asarray(["a", "b", "a", "b"], dtype=object)})
    alg = build_algorithm(AlgorithmConfig(name="reinforce_plus_plus_baseline"))
    out = alg.advantages(None, StepState(0), batch)
    # minus the group means (0.5 and 2) on every real token, then whitened over the 6 real tokens
    centred = torch.tensor([[0.5, 0.5], [1.0, 0.0], [-0.5, -0.5], [-1.0, 0.0]])
    real = centred[mask.bool()]
    expected = (centred - real.mean()) / (real.var() + 1e-8).sqrt() * mask
    assert torch.allclose(out.batch["advantages"], expected, atol=1e-5)


def test_rollout_correction_auto_is_off_only_on_the_colocated_same_precision_path():
    assert resolve_rollout_correction(RolloutCorrectionConfig(), same_precision=True).mode == "off"
    on = resolve_rollout_correction(RolloutCorrectionConfig(), same_precision=False)
    assert (on.mode, on.level, on.cap) == ("tis", "token", 2.0)
    assert resolve_rollout_correction(RolloutCorrectionConfig(), same_precision=True, off_policy=True).mode == "tis"
    mis = resolve_rollout_correction(RolloutCorrectionConfig(mode="mis", level="sequence", low=0.8), same_precision=True)
    assert (mis.mode, mis.level, mis.low, mis.high) == ("mis", "sequence", 0.8, 2.0)


# ------------------------------------------------------------------- ReMax, Safe-RLHF
def test_remax_baseline_is_the_greedy_score_repeated_over_the_samples():
    class GreedyTrainer:
        def generate(self, prompts, state, sampling, keep_metrics=True):
            assert sampling == {"greedy": True, "n": 1, "seed": None} and not keep_metrics
            return DataProto({"r": torch.zeros(2)})

        def score(self, batch):
            return DataProto({"scores": torch.tensor([0.25, 0.75]), "cost_scores": torch.tensor([1.0, 0.0])})

    state = StepState(0, prompts=DataProto({"x": torch.zeros(2)}))
    out = build_algorithm(AlgorithmConfig(name="remax")).after_scoring(GreedyTrainer(), state, DataProto({"y": torch.zeros(6)}))
    assert out.batch["baseline_scores"].tolist() == [0.25] * 3 + [0.75] * 3
    assert out.batch["baseline_cost_scores"].tolist() == [1.0] * 3 + [0.0] * 3
    assert "gen_baseline" in state.timing


def test_safe_rlhf_folds_the_cost_advantages_in_and_steps_lambda_after_the_update():
    config = AlgorithmConfig(name="grpo", safe_rlhf_lambda_init=0.5, safe_rlhf_lambda_lr=0.1, safe_rlhf_cost_limit=0.2)
    alg = build_algorithm(config, safe_rlhf=True)
    assert isinstance(alg, SafeRLHF) and alg.estimator == "grpo"
    mask = torch.ones(4, 1)
    batch = DataProto({"token_level_scores": torch.tensor([[1.0], [0.0], [2.0], [0.0]]), "response_mask": mask,
                       "cost_token_level_scores": torch.tensor([[0.0], [1.0], [1.0], [1.0]]),
                       "cost_scores": torch.tensor([0.0, 1.0, 1.0, 1.0])},
                      {"uid": np.asarray(["a", "a", "b", "b"], dtype=object)})
    state = StepState(0, prompts=DataProto({"x": torch.zeros(2)}))
    inputs = lambda key: AdvantageInputs(batch.batch[key].clone(), mask, group_index=["a", "a", "b", "b"])
    reward_adv, _ = compute_advantages("grpo", inputs("token_level_scores"))
    cost_adv, _ = compute_advantages("grpo", inputs("cost_token_level_scores"))
    out = alg.advantages(None, state, batch)
    torch.testing.assert_close(out.batch["advantages"], combine_advantages(reward_adv, cost_adv, 0.5))
    assert state.metrics["safe_rlhf/lambda"] == 0.5 and state.metrics["safe_rlhf/cost/mean"] == 0.75
    alg.after_update(None, state, out)
    assert alg.lagrange.value == pytest.approx(0.5 + 0.1 * (0.75 - 0.2))
    restored = build_algorithm(config, safe_rlhf=True)
    restored.load_state_dict(alg.state_dict())
    assert restored.lagrange.value == alg.lagrange.value


# ------------------------------------------------------------------------ registry
def test_a_user_algorithm_by_name_and_by_import_path(tmp_path, monkeypatch):
    @register_algorithm("test_clipped_grpo")
    class ClippedGRPO(RLAlgorithm):
        preset = "grpo"

    try:
        cls, preset = resolve_algorithm("test_clipped_grpo")
        assert cls is ClippedGRPO and preset.estimator == "grpo"
        assert AlgorithmConfig(name="test_clipped_grpo").estimator == "grpo"
        with pytest.raises(ValueError, match="'test_clipped_grpo' is already registered; pass override=True"):
            register_algorithm("test_clipped_grpo")(type("Other", (RLAlgorithm,), {"preset": "grpo"}))
    finally:
        ALGORITHMS.pop("test_clipped_grpo")
    (tmp_path / "my_algos.py").write_text(textwrap.dedent("""
        from controller.algorithms import RLAlgorithm

        class Halved(RLAlgorithm):
            preset = "rloo"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cls, preset = resolve_algorithm("my_algos:Halved")
    assert cls.__name__ == "Halved" and preset.estimator == "rloo"
    with pytest.raises(ValueError, match="algorithm.name 'my_algos:Nope': cannot import it"):
        resolve_algorithm("my_algos:Nope")
    with pytest.raises(ValueError, match="preset must be an AlgorithmPreset or a built-in name"):
        register_algorithm("test_bad")(type("Bad", (RLAlgorithm,), {}))
    sys.modules.pop("my_algos", None)


SCALED_GRPO = """
    from dataclasses import dataclass

    from controller.algorithms import RLAlgorithm


    class ScaledGRPO(RLAlgorithm):
        \"\"\"GRPO whose advantages are multiplied by a setting of its own.\"\"\"

        preset = "grpo"

        @dataclass(frozen=True)
        class Config:
            advantage_scale: float = 1.0

            def __post_init__(self):
                if not self.advantage_scale > 0:
                    raise ValueError(f"advantage_scale must be > 0, got {self.advantage_scale}")

        def advantages(self, ctx, state, batch):
            batch = super().advantages(ctx, state, batch)
            batch.batch["advantages"] = batch.batch["advantages"] * self.settings.advantage_scale
            return batch
"""


def write_scaled_grpo(folder) -> None:
    """A user's algorithm with a typed setting of its own, in one file outside the project (my_algos.py)."""
    (folder / "my_algos.py").write_text(textwrap.dedent(SCALED_GRPO))


def test_an_algorithm_owns_its_typed_settings(tmp_path, monkeypatch):
    """``algorithm.advantage_scale`` belongs to my_algos:ScaledGRPO's nested Config: parsed beside the shared
    keys, typed and checked before launch, and read by its hooks as ``self.settings``."""
    from controller.algorithms.algorithm import NoSettings
    from controller.config import config_from_dict, config_to_dict

    write_scaled_grpo(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["algorithm.name=my_algos:ScaledGRPO", "rollout.sampling.n=2"]
    try:
        config = load_config(ROOT / "examples" / "ppo_tiny.yaml", [*base, "algorithm.advantage_scale=0.5",
                                                                    "algorithm.gamma=0.9"])
        assert config.algorithm.settings.advantage_scale == 0.5 and config.algorithm.gamma == 0.9
        check_config(config)
        algorithm = build_algorithm(config.algorithm)
        assert algorithm.settings.advantage_scale == 0.5
        assert config_from_dict(config_to_dict(config)) == config  # the tree round-trips (a run's config.yaml)
        assert build_algorithm(load_config(ROOT / "examples" / "ppo_tiny.yaml", base).algorithm).settings \
            .advantage_scale == 1.0  # its default
        # The same batch through GRPO and through ScaledGRPO: advantages x 0.5.
        batch = DataProto({"token_level_scores": torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [0.0, 2.0]]),
                           "response_mask": torch.ones(4, 2)}, {"uid": np.array(["a", "a", "b", "b"], dtype=object)})
        plain = build_algorithm(AlgorithmConfig(name="grpo")).advantages(None, StepState(1), batch.union(DataProto({})))
        scaled = algorithm.advantages(None, StepState(1), batch)
        torch.testing.assert_close(scaled.batch["advantages"], 0.5 * plain.batch["advantages"])
        for value, message in (("abc", "algorithm.advantage_scale: expected a number, got 'abc'"),
                               ("-1", "algorithm: advantage_scale must be > 0, got -1.0")):
            with pytest.raises(ConfigError, match=message):
                load_config(ROOT / "examples" / "ppo_tiny.yaml", [*base, f"algorithm.advantage_scale={value}"])
        with pytest.raises(ConfigError, match=r"algorithm: unknown key\(s\) \['advantage_scal'\]; valid keys: .*"
                                              r"and my_algos:ScaledGRPO's own: \['advantage_scale'\]"):
            load_config(ROOT / "examples" / "ppo_tiny.yaml", [*base, "algorithm.advantage_scal=0.5"])
    finally:
        sys.modules.pop("my_algos", None)
    assert build_algorithm(AlgorithmConfig(name="grpo")).settings == NoSettings()  # built-ins declare none


def test_config_checks_name_the_algorithm_settings():
    def problems(*overrides):
        with pytest.raises(ConfigError) as info:
            check_config(load_config(ROOT / "examples" / "ppo_tiny.yaml", list(overrides)))
        return str(info.value)

    assert "algorithm.dynamic_sampling is a DAPO setting; algorithm.name is 'grpo' (use dapo)" in problems(
        "algorithm.name=grpo", "rollout.sampling.n=2", "algorithm.dynamic_sampling=true")
    assert "algorithm.max_gen_batches must be >= 1" in problems("algorithm.name=dapo", "rollout.sampling.n=2",
                                                                "algorithm.max_gen_batches=0")
    assert "algorithm.overlong_buffer_len must be in [0, rollout.sampling.max_new_tokens" in problems(
        "algorithm.name=dapo", "rollout.sampling.n=2", "algorithm.overlong_buffer_len=1000")
    assert "algorithm.rollout_correction: rollout correction mode 'is' is not one of" in problems(
        "algorithm.rollout_correction.mode=is")
    assert "reinforce_plus_plus_baseline compares samples of one prompt" in problems(
        "algorithm.name=reinforce_plus_plus_baseline", "rollout.sampling.n=1")
    assert "algorithm.name 'nope:Thing': cannot import it" in problems("algorithm.name=nope:Thing")


# -------------------------------------------------------------- the trainer's choice
def test_the_trainer_takes_a_name_a_config_or_an_object_and_wraps_it_for_a_cost():
    from controller.data import arithmetic_prompts
    from controller.rl.trainer import RLTrainer
    from workers.actor import Actor
    from workers.rollout import Rollout

    def trainer(**kwargs):
        return RLTrainer(actor=Actor.from_pretrained("policy"), rollout=Rollout.from_pretrained("policy", sampling={"n": 2}),
                         reward_fn="arithmetic_answer", train_data=arithmetic_prompts(8, seed=0), batch_size=4, **kwargs)

    assert isinstance(trainer(algorithm="dapo").algorithm, DAPO)
    assert trainer(algorithm={"name": "gspo"}).algorithm.defaults.policy_loss == "gspo"
    mine = build_algorithm(AlgorithmConfig(name="rloo"))
    assert trainer(algorithm=mine).algorithm is mine
    wrapped = trainer(algorithm=mine, cost_fn="format_check").algorithm
    assert isinstance(wrapped, SafeRLHF) and wrapped.inner is mine and "cost" in trainer(algorithm=mine, cost_fn="format_check").specs
    with pytest.raises(ConfigError, match="ppo estimates advantages with GAE and needs a critic"):
        trainer(algorithm="ppo")
    with pytest.raises(ValueError, match="algorithm.name 'a2c' is not registered"):
        trainer(algorithm="a2c")
