"""The roles of an RL job, declared from its typed config: one ``RoleSpec`` per role, nothing loaded yet.

``declare_roles(config, algorithm, policy_path)`` reads the tree (``controller.config.RLConfig``) and gives the
actor, the rollout, the critic where the estimator needs one, the reference where a KL term reads
it, and the reward (a rule, a reward model or the user's worker), through ``assemble_roles``; then the
algorithm's own roles (its ``roles`` hook: Safe-RLHF's cost) and the registered ones the config holds. Every role's worker and keywords are checked here, before any process starts.
A ``worker`` given as ``"package.module:Class"`` is imported now.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from controller.config import RoleConfig
from controller.errors import ConfigError
from controller.rl.judge_scores import judge_scores
from controller.rl.role_assembly import assemble_roles
from controller.rl.role_defaults import reading_policy_ids
from controller.rl.role_registry import ROLE_TYPES, role_engine
from workers.actor import Actor, ReferencePolicy
from workers.critic import Critic
from workers.import_path import import_object
from workers.keywords import check_constructor
from workers.pretrained import resolve_pretrained
from workers.reward import RewardModel, RuleReward
from workers.role_spec import RoleSpec
from workers.rollout import Rollout
from workers.user_kl import check_kl_loss_fn

__all__ = ["DeclaredRoles", "declare_roles", "kl_loss_function", "with_parallelism", "with_resolved_paths", "worker_class"]


def worker_class(value: str | type | None, base: type, key: str) -> type:
    """The worker a config names (a class, an import path, or None: ``base``); a subclass of ``base``."""
    if value is None:
        return base
    cls = import_object(value, key) if isinstance(value, str) else value
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{key}: {value!r} is not a subclass of {base.__name__}")
    return cls


def kl_loss_function(value: str | Callable | None) -> Callable | None:
    """``algorithm.kl_loss_fn`` as a function (an import path is imported now) checked to take
    ``(actor_outputs, ref_outputs, step)``, or None."""
    if value is None:
        return None
    return check_kl_loss_fn(import_object(value, "algorithm.kl_loss_fn") if isinstance(value, str) else value)


def _engine_role(cls: type, path: str, role_cfg, **kwargs: Any) -> RoleSpec:
    """A megatron role on its config section: the typed sections go to the worker as they are."""
    engine = role_cfg.engine
    if role_cfg.lora.enabled:  # a trained role's adapters (check_config refuses them on the others)
        kwargs["lora"] = role_cfg.lora
    return RoleSpec(cls, {"model_path": path, "engine": engine, **kwargs},
                    device_map=role_cfg.device_map,
                    explicit_parallelism=(engine.tensor_parallel, engine.pipeline_parallel) != (1, 1))


def _reward_model(role_cfg, model_path: str, max_length: int | None = None) -> RoleSpec:
    engine = role_cfg.engine
    return RewardModel.from_pretrained(
        model_path, engine=engine, tensor_parallel=engine.tensor_parallel,
        pipeline_parallel=engine.pipeline_parallel, micro_batch_size=engine.micro_batch_size,
        device_map=role_cfg.device_map, **({"max_length": max_length} if max_length is not None else {}))


def _judge(section, actor_path: str) -> RoleSpec:
    """The generative judge on its checkpoint, reading the policy's token ids with the actor's tokenizer."""
    from workers.reward.judge import GenerativeJudge

    path = resolve_pretrained(section.model_path, missing_ok=True)
    return RoleSpec(GenerativeJudge, {"model_path": path, "tokenizer_path": actor_path,
                                      "config": replace(section, model_path=path)})


def with_resolved_paths(config):
    """``config`` with each model path that names a hub id replaced by its cached snapshot (once, here)."""
    def resolved(section):
        if section is None or section.model_path is None:
            return section
        return replace(section, model_path=resolve_pretrained(section.model_path, missing_ok=True))

    model_path = config.model_path
    if not model_path.startswith("builtin:"):
        model_path = resolve_pretrained(model_path, missing_ok=True)
    return replace(config, model_path=model_path, actor=resolved(config.actor), critic=resolved(config.critic),
                   ref_policy=resolved(config.ref_policy), cost_model=resolved(config.cost_model))


@dataclass(frozen=True)
class DeclaredRoles:
    """A job's roles: each one's RoleSpec by name, and the calls the step makes at each phase on the roles
    that are not built in (the algorithm's own, then the registered ones): ``calls[phase]`` is a list of
    (role, call)."""

    specs: dict[str, RoleSpec]
    calls: dict[str, list[tuple[str, Callable]]] = field(default_factory=dict)


@dataclass(frozen=True)
class _JobRoles:
    """The job's way of declaring a scorer, for an algorithm's ``roles`` hook (its ``RoleContext``)."""

    config: Any
    policy_path: str
    actor_path: str
    reward_options: dict[str, Any]

    def rule(self, fn) -> RoleSpec:
        return RoleSpec(RuleReward, {"tokenizer_path": self.actor_path, "reward_fn": fn, **self.reward_options})

    def reward_model(self, section) -> RoleSpec:
        return reading_policy_ids(_reward_model(section, section.model_path), self.actor_path)


def declare_roles(config, algorithm, policy_path: str) -> DeclaredRoles:
    """The job's roles by name (``controller.rl.role_assembly.ROLE_ORDER``, then the algorithm's own and the
    registered ones), from ``config`` (an RLConfig) for ``algorithm`` (the RLAlgorithm), with ``policy_path``
    the policy checkpoint (``config.model_path`` resolved). ConfigError (or the worker's TypeError /
    ValueError) on a role that cannot be declared."""
    actor_path = config.actor.model_path or policy_path
    actor = _engine_role(worker_class(config.actor.worker, Actor, "actor.worker"), actor_path, config.actor,
                         optim=config.actor.optim, ppo=config.ppo,
                         **({} if config.actor.freeze_vision_tower else {"freeze_vision_tower": False}))
    rollout_cfg = config.rollout
    isolation = config.sandbox.isolation
    sandbox = {"sandbox_isolation": isolation} if isolation != "auto" else {}  # the workers' default otherwise
    rollout = RoleSpec(Rollout, {"model_path": policy_path, "actor_role": "actor",
                                 "config": rollout_cfg, **sandbox},
                       device_map=rollout_cfg.device_map,
                       explicit_parallelism=(rollout_cfg.tensor_parallel, rollout_cfg.pipeline_parallel) != (1, 1))
    critic = None
    if algorithm.needs_critic:
        critic = _engine_role(worker_class(config.critic.worker, Critic, "critic.worker"),
                              config.critic.model_path or policy_path, config.critic,
                              optim=config.critic.optim, critic=config.critic_ppo)
    ref_policy = None
    if config.ref_policy is not None:
        ref = config.ref_policy
        ref_policy = _engine_role(worker_class(ref.worker, ReferencePolicy, "ref_policy.worker"),
                                  ref.model_path or actor_path, ref)
    reward = config.reward
    reward_model = reward_worker = reward_fn = None
    if reward.worker is not None:
        cls = import_object(reward.worker, "reward.worker") if isinstance(reward.worker, str) else reward.worker
        if not hasattr(cls, "compute_reward"):
            raise ConfigError(f"reward.worker {reward.worker!r} has no compute_reward(batch) method")
        check_constructor(cls, reward.worker_kwargs, f"reward.worker {cls.__name__}")
        reward_worker = RoleSpec(cls, dict(reward.worker_kwargs))
    elif reward.model_path is not None:
        reward_model = reading_policy_ids(_reward_model(reward, reward.model_path, reward.max_length), actor_path)
    else:
        reward_fn = reward.fn
    options = {"max_concurrency": reward.max_concurrency, "timeout_s": reward.timeout_s, **sandbox}
    judge = reward.judge
    if judge is not None and judge.data_sources:  # the rule leaves the judge's rows to it
        options["skip_data_sources"] = judge.data_sources
    specs = assemble_roles(
        algorithm=algorithm, ppo=config.ppo, actor=actor, rollout=rollout, critic=critic, ref_policy=ref_policy,
        reward_model=reward_model, reward_fn=reward_fn, reward_kwargs=reward.kwargs or None, reward_options=options,
        reward_worker=reward_worker, kl_loss_fn=kl_loss_function(config.algorithm.kl_loss_fn),
        judge=_judge(judge, actor_path) if judge is not None else None)
    calls: dict[str, list[tuple[str, Callable]]] = {}
    if judge is not None:  # the judge's scores first: the other scoring roles read the combined reward
        calls["score"] = [("judge", partial(judge_scores, weight=judge.weight, data_sources=judge.data_sources))]
    job = _JobRoles(config, policy_path, actor_path, options)
    for name, role in algorithm.roles(job).items():
        if name in specs:
            raise ConfigError(f"{type(algorithm).__name__}.roles(): role {name!r} is already one of the job's "
                              f"roles {sorted(specs)}")
        specs[name] = role.spec
        calls.setdefault(role.phase, []).append((name, role.call))
    for name, section in config.roles.items():  # the registered roles the config holds (role_registry)
        if name in ROLE_TYPES:
            role_type = ROLE_TYPES[name]
            specs[name] = role_type.spec(section, job)
            calls.setdefault(role_type.phase, []).append((name, role_type.call))
    return DeclaredRoles(specs, calls)


def with_parallelism(config, role: str, tensor_parallel: int | None, pipeline_parallel: int | None,
                     context_parallel: int | None = None):
    """``config`` with ``role``'s TP / PP (/ CP) set (None: as it is), as the user's own (no device_map)."""
    sizes = {k: v for k, v in (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel),
                               ("context_parallel", context_parallel)) if v is not None}
    if role == "rollout":
        return replace(config, rollout=replace(config.rollout, **sizes, device_map=None))
    engine = role_engine(config, role)
    if engine is not None:  # a registered role holding a model (the teacher)
        section = config.roles[role]
        unplaced = {"device_map": None} if hasattr(section, "device_map") else {}
        return replace(config, roles={**config.roles, role: replace(section, engine=replace(engine, **sizes),
                                                                     **unplaced)})
    sections = {"actor": "actor", "critic": "critic", "ref_policy": "ref_policy", "reward_model": "reward",
                "cost": "cost_model"}
    if role not in sections:
        raise ConfigError(f"role {role!r} has no model parallelism to set; roles with one: "
                          f"{sorted([*sections, *(r for r in config.roles if role_engine(config, r) is not None)])}")
    section = getattr(config, sections[role])
    if section is None:  # the reference: the actor's model and engine until set
        section = RoleConfig(engine=config.actor.engine)
    section = replace(section, engine=replace(section.engine, **sizes), device_map=None)
    return replace(config, **{sections[role]: section})
