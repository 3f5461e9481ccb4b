"""The roles an RL job needs, from what the user declared: actor, rollout, critic, reference, reward.

``assemble_roles`` checks that the declared roles fit the algorithm (one reward source; a critic
where the estimator is GAE), adds the roles the algorithm implies (a reference policy where a KL term
reads one, the rule-reward worker), and returns them by name, in the order the trainer builds them.
An algorithm's own roles (Safe-RLHF's cost) come from its ``roles`` hook (``controller.rl.role_specs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from controller.errors import ConfigError
from workers.megatron.lora import LoRAConfig
from workers.reward import RuleReward
from workers.role_spec import RoleSpec

__all__ = ["ROLE_ORDER", "assemble_roles", "check_reward_sources", "lora_actor", "needs_reference", "reference_role"]

ROLE_ORDER = ("actor", "rollout", "ref_policy", "critic", "reward_model", "reward", "judge", "cost")


def assemble_roles(
    *,
    algorithm,  # the RLAlgorithm
    ppo,  # the actor's PPOActorConfig
    actor: RoleSpec,
    rollout: RoleSpec,
    critic: RoleSpec | None = None,
    ref_policy: RoleSpec | None = None,
    reward_model: RoleSpec | None = None,
    reward_fn: str | Callable | None = None,
    reward_kwargs: dict[str, Any] | None = None,
    reward_options: dict[str, Any] | None = None,  # RuleReward's max_concurrency, timeout_s, sandbox_isolation
    reward_worker: RoleSpec | None = None,
    kl_loss_fn: Callable | None = None,
    judge: RoleSpec | None = None,
) -> dict[str, RoleSpec]:
    config = algorithm.config
    check_reward_sources(reward_fn, reward_model, reward_worker, judged=judge is not None)
    if algorithm.needs_critic and critic is None:
        raise ConfigError(f"{config.name} estimates advantages with GAE and needs a critic (critic=Critic.from_pretrained(...))")
    if config.router_replay != "off":  # the rollout reports the experts it routed each token to
        rollout = _returning_routes(rollout)
    if lora_actor(actor):  # the rollout learns the adapters' shape (an engine serving them unmerged needs it)
        lora = actor.kwargs["lora"]
        rollout = _with_rollout_config(rollout, lora_adapter=LoRAConfig(rank=lora.rank, alpha=lora.alpha,
                                                                        target_modules=lora.targets))
    specs: dict[str, RoleSpec] = {"actor": actor, "rollout": rollout}
    if critic is not None:
        specs["critic"] = critic
    if needs_reference(config, ppo, kl_loss_fn) and (ref_policy is not None or not lora_actor(actor)):
        specs["ref_policy"] = ref_policy or RoleSpec(_reference_cls(), {  # the actor's model, engine and layout rule
            "model_path": actor.model_path, "engine": actor.kwargs.get("engine")},
            device_map=actor.device_map, explicit_parallelism=actor.explicit_parallelism)
    if reward_model is not None:
        specs["reward_model"] = reward_model
    if reward_fn is not None:
        specs["reward"] = RoleSpec(RuleReward, {"tokenizer_path": actor.model_path, "reward_fn": reward_fn,
                                                "reward_kwargs": reward_kwargs, **(reward_options or {})})
    if reward_worker is not None:
        specs["reward"] = reward_worker
    if judge is not None:
        specs["judge"] = judge
    return specs


def needs_reference(config, ppo, kl_loss_fn=None) -> bool:
    """Whether the step reads reference log-probs: the algorithm's ``use_reference``, else a KL term."""
    return config.use_reference if config.use_reference is not None else (
        config.kl_in_reward or ppo.use_kl_loss or kl_loss_fn is not None)


def lora_actor(actor: RoleSpec) -> bool:
    """The actor trains LoRA adapters: its frozen base, the adapters off, is the reference policy, so a job
    declares no reference of its own (``Actor.compute_ref_log_prob``)."""
    lora = actor.kwargs.get("lora")
    return lora is not None and lora.enabled


def reference_role(specs: dict[str, RoleSpec], config, ppo, kl_loss_fn=None) -> str | None:
    """The role that answers ``compute_ref_log_prob``: the reference policy, a LoRA actor, or none."""
    if "ref_policy" in specs:
        return "ref_policy"
    return "actor" if lora_actor(specs["actor"]) and needs_reference(config, ppo, kl_loss_fn) else None


def check_reward_sources(reward_fn, reward_model, reward_worker, judged: bool = False) -> None:
    """ConfigError unless exactly one reward source is given (or none, where a generative judge scores)."""
    given = sum(x is not None for x in (reward_fn, reward_model, reward_worker))
    if given > 1 or (given == 0 and not judged):
        raise ConfigError("give exactly one of reward_fn (a rule), reward_model (a RewardModel spec) or "
                          "reward_worker (your own worker with compute_reward(batch) -> token_level_scores, scores)"
                          + ("" if judged else ", or a generative judge (reward.judge) alone"))


def _returning_routes(rollout: RoleSpec) -> RoleSpec:
    """``rollout`` with ``return_routed_experts`` set in its config."""
    return _with_rollout_config(rollout, return_routed_experts=True)


def _with_rollout_config(rollout: RoleSpec, **fields: Any) -> RoleSpec:
    """``rollout`` with ``fields`` set in its typed config."""
    from workers.rollout.config import RolloutConfig

    config = dataclasses.replace(rollout.kwargs.get("config") or RolloutConfig(), **fields)
    return dataclasses.replace(rollout, kwargs={**rollout.kwargs, "config": config})


def _reference_cls():
    from workers.actor import ReferencePolicy

    return ReferencePolicy
