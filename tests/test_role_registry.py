"""A role added in one file (``length_bonus_role.py``), with the trainer, the job's assembly and the config tree
untouched: its section is typed and checked before launch, it is declared, placed and built as a worker group
like the built-in roles, and the step calls it after the reward. The scores it gives are the rule reward's plus
its bonus, computed here by hand from the responses' lengths."""

import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RUN = ["trainer.launcher=ray", "trainer.nproc=1", "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1", "rollout.engine=megatron", "algorithm.name=grpo",
       "rollout.sampling.n=2", "rollout.sampling.max_new_tokens=4", "rollout.max_prompt_length=8",
       "data.batch_size=2", "data.train_size=16", "data.val_size=2", "ppo.ppo_mini_batch_size=4",
       "actor.engine.micro_batch_size=2", "trainer.val_every=0", "trainer.save_every=0", "trainer.export_hf=false",
       "trainer.logger=[jsonl]", "trainer.plots=false"]


def test_a_role_in_one_file_is_declared_placed_built_and_called_by_the_step(tmp_path, ray_cluster):
    import length_bonus_role  # noqa: F401  (registers the role)

    from controller.config import ConfigError, check_config, config_from_dict, config_to_dict, load_config
    from controller.models.builtin import resolve_model_path
    from controller.rl.trainer import RLTrainer

    model = resolve_model_path("builtin:tiny-arithmetic", tmp_path)
    config = load_config(ROOT / "examples" / "ppo_tiny.yaml", [f"model_path={model}", *RUN, "length_bonus.weight=0.5"])
    assert config.roles["length_bonus"].weight == 0.5
    assert config_from_dict(config_to_dict(config)) == config  # a run's config.yaml reads back the same
    with pytest.raises(ConfigError, match="length_bonus.weight: expected a number, got 'much'"):
        load_config(ROOT / "examples" / "ppo_tiny.yaml", ["length_bonus.weight=much"])
    with pytest.raises(ConfigError, match="length_bonus: weight must be >= 0, got -1.0"):
        load_config(ROOT / "examples" / "ppo_tiny.yaml", ["length_bonus.weight=-1"])
    with pytest.raises(ConfigError, match=r"roles.judge: no role 'judge' is registered"):
        check_config(config_from_dict({**config_to_dict(config), "roles": {"judge": {}}}))
    trainer = RLTrainer(config)
    try:
        metrics = trainer.step()  # the step scores with the role
        assert "length_bonus" in trainer.groups and math.isfinite(metrics["actor/pg_loss"])
        batch = trainer.generate(trainer.loader.next_batch(), None, {"seed": 5}, keep_metrics=False)
        rule = trainer.groups["reward"].compute_reward(batch).batch["scores"]
        scored = trainer.score(batch)
        lengths = batch.batch["response_mask"].sum(-1).float()
        torch.testing.assert_close(scored.batch["scores"], rule + 0.5 * lengths)
        torch.testing.assert_close(scored.batch["token_level_scores"].sum(-1), rule + 0.5 * lengths)
    finally:
        trainer.shutdown()


def test_an_algorithm_adds_a_role_of_its_own_through_its_roles_hook(tmp_path):
    """``RLAlgorithm.roles``: the role is declared beside the job's own with its call at its phase, after the
    algorithm's inner roles (Safe-RLHF's cost, by the hook too); a name the job already has is refused. No
    process starts: the declaration is pure (the step's call is covered by the Safe-RLHF runs)."""
    from length_bonus_role import LengthBonus, add_bonus

    from controller.algorithms import RLAlgorithm, SafeRLHF, build_algorithm
    from controller.algorithms.algorithm_roles import AlgorithmRole
    from controller.config import ConfigError, load_config
    from controller.models.builtin import resolve_model_path
    from controller.rl.role_specs import declare_roles
    from workers.reward import RuleReward
    from workers.role_spec import RoleSpec

    class WithBonus(RLAlgorithm):
        preset = "grpo"
        name = "bonus"

        def roles(self, job):
            return {self.name: AlgorithmRole(RoleSpec(LengthBonus, {"weight": 0.25}), "score", add_bonus)}

    model = str(resolve_model_path("builtin:tiny-arithmetic", tmp_path))
    config = load_config(ROOT / "examples" / "ppo_tiny.yaml", [f"model_path={model}", *RUN,
                                                               "algorithm.safe_rlhf_cost_fn=format_check"])
    mine = WithBonus(config.algorithm, build_algorithm(config.algorithm).defaults)
    declared = declare_roles(config, SafeRLHF(mine), model)
    assert declared.specs["bonus"].worker_cls is LengthBonus and declared.specs["bonus"].kwargs == {"weight": 0.25}
    cost = declared.specs["cost"]
    assert cost.worker_cls is RuleReward and cost.kwargs["reward_fn"] == "format_check"
    assert [name for name, _ in declared.calls["score"]] == ["bonus", "cost"]
    assert declared.calls["score"][0][1] is add_bonus
    with pytest.raises(ConfigError, match=r"WithBonus.roles\(\): role 'reward' is already one of the job's roles"):
        mine.name = "reward"
        declare_roles(config, mine, model)
    with pytest.raises(ValueError, match="AlgorithmRole.phase 'later' is not one of"):
        AlgorithmRole(RoleSpec(LengthBonus, {"weight": 0.25}), "later", add_bonus)
