"""The researcher's keyword API, ``RLTrainer(actor=..., critic=..., kl_loss_fn=...)``: a builder of the typed tree.

``config_from_keywords(**keywords)`` turns the declared roles (``X.from_pretrained(...)`` specs) and
the keywords into an ``RLConfig`` and the ``TrainerInputs`` that are objects rather than values
(the prompt datasets, an algorithm object, a pool, a logger). ``RLTrainer`` then runs from those
exactly as it runs from a YAML file's config: there is one path after this module.

What the keywords leave out follows what the user gave: no ``rollout=`` generates from the actor's
model (vLLM where installed, megatron otherwise, laid out by ``device_map="auto"``'s rule); ``lr``
is the actor's and critic's learning rate; a critic on a causal LM gets verl's normal-initialised
value head. A wrong keyword, or a value of the wrong kind, raises here, before any process starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controller.algorithms import RLAlgorithm
from controller.algorithms.config import AlgorithmConfig
from controller.algorithms.safe_rlhf import check_cost_sources
from controller.config import DataConfig, RewardConfig, RLConfig, RoleConfig, TrainerConfig, build_section
from controller.errors import ConfigError
from controller.rl.role_assembly import check_reward_sources
from controller.rl.role_defaults import check_declared_roles, default_rollout, with_learning_rate
from controller.rl.trainer_inputs import TrainerInputs
from controller.runtime.torchrun_backend import under_torchrun
from workers.actor import Actor, PPOActorConfig, ReferencePolicy
from workers.critic import Critic, CriticConfig
from workers.data_schema import ROLLOUT_FIELDS, DataSchema
from workers.megatron.config import EngineConfig, OptimConfig
from workers.reward import RewardModel
from workers.reward.hf_reward_model import HFRewardModel
from workers.role_spec import RoleSpec
from workers.rollout import Rollout
from workers.rollout.config import RolloutConfig

__all__ = ["config_from_keywords"]


def config_from_keywords(
    *,
    actor: RoleSpec,
    train_data,
    batch_size: int,
    rollout: RoleSpec | None = None,
    lr: float | None = None,
    rollout_proto: DataSchema | None = None,
    critic: RoleSpec | None = None,
    ref_policy: RoleSpec | None = None,
    reward_model: RoleSpec | None = None,
    reward_fn: str | Callable | None = None,
    reward_kwargs: dict[str, Any] | None = None,
    reward_worker: RoleSpec | None = None,
    cost_fn: str | Callable | None = None,
    cost_model: RoleSpec | None = None,
    teacher: RoleSpec | None = None,
    algorithm: AlgorithmConfig | dict | str | RLAlgorithm = "ppo",
    val_data=None,
    kl_loss_fn: Callable | None = None,
    processes: int | None = None,
    backend: str = "auto",
    ray_address: str | None = None,
    pool=None,
    run_dir: str | Path | None = None,
    logger=None,
    save_every: int = 0,
    val_every: int = 0,
    val_before_train: bool = False,
    seed: int = 0,
    shuffle: bool = True,
    mode: str = "sync",
    max_staleness: int = 1,
    partial_rollout_tokens: int | None = None,
    max_in_flight: int | None = None,
    rollout_data_dir: str | Path | None = None,
    verbose: bool = False,
) -> tuple[RLConfig, TrainerInputs]:
    """The config and inputs that ``RLTrainer(**keywords)`` runs from (the keywords: ``RLTrainer``'s).

    ``algorithm``: a name, an AlgorithmConfig (or its dict), or an RLAlgorithm object. ``mode``: "sync";
    "one_step_off" (the rollout on a pool of its own generates step k+1 while step k trains); or "async" (it
    generates a stream of samples, ``partial_rollout_tokens`` per sample per call, None: whole responses,
    with at most ``max_in_flight`` prompt groups at once, None: as the staleness bound allows). Samples more
    than ``max_staleness`` updates stale are not trained on; see ``controller.rl.schedules``.
    ``rollout_data_dir``: each step's samples, with the per-token advantages they trained on, as
    ``{dir}/{step}.jsonl`` (``controller.rl.rollout_dump``). ``rollout`` None: generation from the actor's
    model, in vLLM where it is installed (megatron otherwise), laid out by ``device_map="auto"``'s rule.
    ``lr``: the actor's (and critic's) learning rate, where their own ``optim`` does not set one.
    ``rollout_proto``: a schema (``DataProto(field="name", ...)``) of the fields the rollout must produce,
    checked now and on the first batch. ``verbose``: one console line per phase of each step. ``teacher``: a
    ``Teacher.from_pretrained(path)`` that scores every sampled token, read by ``algorithm="opd"`` (on-policy
    distillation) or by ``algorithm={"name": ..., "teacher_kl_coef": c}`` (``controller.rl.teacher``).
    """
    check_declared_roles(actor=actor, rollout=rollout, critic=critic, ref_policy=ref_policy,
                         reward_model=reward_model, reward_worker=reward_worker, cost_model=cost_model, teacher=teacher)
    check_reward_sources(reward_fn, reward_model, reward_worker)  # before they fill one section
    check_cost_sources(cost_fn, cost_model)
    if rollout_proto is not None:
        if not isinstance(rollout_proto, DataSchema):
            raise TypeError(f"rollout_proto takes a schema, DataProto(field='name', ...); got {rollout_proto!r}")
        rollout_proto.check(getattr(rollout.worker_cls if rollout is not None else Rollout, "produces", ROLLOUT_FIELDS))
    if backend not in ("auto", "ray", "torchrun"):
        raise ConfigError(f"backend {backend!r} is not one of ('auto', 'ray', 'torchrun')")
    if lr is not None:
        actor, critic = with_learning_rate(actor, lr, "actor"), with_learning_rate(critic, lr, "critic")
    algorithm_object, algorithm_config = _algorithm(algorithm)
    if cost_fn is not None:
        algorithm_config = dataclasses.replace(algorithm_config, safe_rlhf_cost_fn=cost_fn)
    if kl_loss_fn is not None:
        algorithm_config = dataclasses.replace(algorithm_config, kl_loss_fn=kl_loss_fn)
    needs_critic = algorithm_object.needs_critic if algorithm_object is not None else algorithm_config.needs_critic
    if needs_critic and critic is None:
        raise ConfigError(f"{algorithm_config.name} estimates advantages with GAE and needs a critic "
                          f"(critic=Critic.from_pretrained(...))")
    if critic is not None and not needs_critic:
        raise ConfigError(f"critic=... is given, but {algorithm_config.name} estimates advantages without one "
                          f"(estimator {algorithm_config.estimator!r}); drop critic= or use a GAE algorithm")

    policy_path = actor.model_path
    actor_kwargs = dict(actor.kwargs)
    ppo = actor_kwargs.pop("ppo", None) or PPOActorConfig()
    config = RLConfig(
        model_path=policy_path,
        actor=_role_config(actor, actor_kwargs, Actor, "actor", model_path=None),
        ppo=ppo,
        rollout=_rollout_config(rollout if rollout is not None else default_rollout(actor), policy_path),
        algorithm=algorithm_config,
        # Through the typed tree's own builder: a value of the wrong kind is refused here, naming its key.
        data=build_section(DataConfig, {"batch_size": batch_size, "shuffle": shuffle}, "data"),
        trainer=build_section(TrainerConfig, dict(
            run_dir=str(run_dir) if run_dir is not None else None, save_every=save_every, val_every=val_every,
            val_before_train=val_before_train, seed=seed, mode=mode, max_staleness=max_staleness,
            partial_rollout_tokens=partial_rollout_tokens, max_in_flight=max_in_flight,
            rollout_data_dir=str(rollout_data_dir) if rollout_data_dir is not None else None,
            rollout_proto=dict(rollout_proto.fields) if rollout_proto is not None else None, log_phases=verbose,
            launcher=("torchrun" if under_torchrun() else "ray") if backend == "auto" else backend,
            ray_address=ray_address, nproc=_processes(processes, pool), nnodes=1), "trainer"),
        reward=_reward_config(reward_fn, reward_kwargs, reward_model, reward_worker),
        ref_policy=_role_config(ref_policy, dict(ref_policy.kwargs), ReferencePolicy, "ref_policy")
        if ref_policy is not None else None,
        cost_model=_cost_model(cost_model) if cost_model is not None else None,
        roles={"teacher": _teacher(teacher)} if teacher is not None else {},
    )
    if critic is not None:
        critic_kwargs = dict(critic.kwargs)
        critic_ppo = critic_kwargs.pop("critic", None) or CriticConfig(value_head_init="normal")  # (from_pretrained's)
        config = dataclasses.replace(config, critic=_role_config(critic, critic_kwargs, Critic, "critic"),
                                     critic_ppo=critic_ppo)
    return config, TrainerInputs(train_data=train_data, val_data=val_data, algorithm=algorithm_object, pool=pool,
                                 logger=logger)


def _algorithm(value) -> tuple[RLAlgorithm | None, AlgorithmConfig]:
    if isinstance(value, RLAlgorithm):
        return value, value.config
    if isinstance(value, str):
        return None, AlgorithmConfig(name=value)
    if isinstance(value, dict):
        return None, build_section(AlgorithmConfig, value, "algorithm")
    if isinstance(value, AlgorithmConfig):
        return None, value
    raise TypeError(f"RLTrainer(algorithm=...) takes a name, an AlgorithmConfig (or its dict) or an RLAlgorithm "
                    f"object; got {type(value).__name__}")


def _processes(processes: int | None, pool) -> int:
    """The default pool's processes: as given, the pool's, else the launcher's world (one without torchrun)."""
    if processes is not None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ConfigError(f"processes must be a positive integer, got {processes!r}")
        return processes
    if pool is not None:
        return pool.world_size
    return int(os.environ.get("WORLD_SIZE", "1"))


def _engine(kwargs: dict[str, Any]) -> EngineConfig:
    return kwargs.pop("engine", None) or EngineConfig()


def _device_map(spec: RoleSpec) -> str | None:
    """A role laid out by the rule: an explicit TP / PP wins (kept in the engine section, no device_map)."""
    return spec.device_map if not spec.explicit_parallelism else None


def _role_config(spec: RoleSpec, kwargs: dict[str, Any], base: type, role: str, **fields: Any) -> RoleConfig:
    """A megatron role's spec as its config section; ``kwargs``: its keywords, less those the caller took."""
    if not issubclass(spec.worker_cls, base):
        raise ConfigError(f"{role}=... declares {spec.worker_cls.__name__}, which is not a {base.__name__}")
    model_path = kwargs.pop("model_path")
    engine = _engine(kwargs)
    optim = kwargs.pop("optim", None) or OptimConfig()
    if kwargs:
        raise ConfigError(f"{role}: keyword(s) {sorted(kwargs)} have no place in the {role}'s config")
    return RoleConfig(**{"model_path": model_path, **fields}, engine=engine, optim=optim, device_map=_device_map(spec),
                      worker=None if spec.worker_cls is base else spec.worker_cls)


def _rollout_config(spec: RoleSpec, policy_path: str) -> RolloutConfig:
    if spec.worker_cls is not Rollout:
        raise ConfigError(f"rollout=... declares {spec.worker_cls.__name__}; the trainer's rollout is Rollout "
                          f"(Rollout.from_pretrained(...))")
    if spec.model_path != policy_path:
        raise ConfigError(f"the rollout generates with the actor's weights: its model {spec.model_path!r} must be "
                          f"the actor's, {policy_path!r}")
    if spec.kwargs.get("actor_role", "actor") != "actor":
        raise ConfigError("rollout=...: actor_role is the trainer's to set (a rollout on a pool of its own: "
                          "register_placement('rollout', n))")
    return dataclasses.replace(spec.kwargs.get("config") or RolloutConfig(), device_map=_device_map(spec))


def _reward_config(fn, kwargs, model: RoleSpec | None, worker: RoleSpec | None) -> RewardConfig:
    if worker is not None:
        return RewardConfig(fn=None, worker=worker.worker_cls, worker_kwargs=dict(worker.kwargs),
                            kwargs=dict(kwargs or {}))
    if model is not None:
        return dataclasses.replace(_reward_model_section(model), kwargs=dict(kwargs or {}))
    return RewardConfig(fn=fn, kwargs=dict(kwargs or {}))


def _reward_model_section(spec: RoleSpec) -> RewardConfig:
    """A RewardModel.from_pretrained spec as the reward section: megatron's engine, or transformers' options."""
    kwargs = dict(spec.kwargs)
    path = kwargs.pop("model_path")
    if kwargs.pop("score_key", "rm_scores") != "rm_scores" or kwargs.pop("tokenizer_path", None) is not None:
        raise ConfigError("reward_model=...: score_key and tokenizer_path are the trainer's to set")
    if spec.worker_cls is HFRewardModel:
        engine = EngineConfig(precision=kwargs.pop("precision"), micro_batch_size=kwargs.pop("micro_batch_size"))
        max_length = kwargs.pop("max_length", None)
        device_map = None
    elif issubclass(spec.worker_cls, RewardModel):
        engine, max_length, device_map = _engine(kwargs), None, _device_map(spec)
    else:
        raise ConfigError(f"reward_model=... declares {spec.worker_cls.__name__}; give RewardModel.from_pretrained(...) "
                          f"or your own worker as reward_worker=")
    if kwargs:
        raise ConfigError(f"reward_model: keyword(s) {sorted(kwargs)} have no place in the reward section")
    return RewardConfig(fn=None, model_path=path, engine=engine, max_length=max_length, device_map=device_map)


def _teacher(spec: RoleSpec):
    """A Teacher.from_pretrained spec as the teacher's section (controller.rl.teacher)."""
    from controller.rl.teacher import TeacherConfig
    from workers.teacher import Teacher

    if not issubclass(spec.worker_cls, Teacher):
        raise ConfigError(f"teacher=... declares {spec.worker_cls.__name__}, which is not a Teacher "
                          f"(Teacher.from_pretrained(path))")
    kwargs = dict(spec.kwargs)
    model_path, engine = kwargs.pop("model_path"), _engine(kwargs)
    if kwargs:
        raise ConfigError(f"teacher: keyword(s) {sorted(kwargs)} have no place in the teacher's config")
    return TeacherConfig(model_path=model_path, engine=engine, device_map=_device_map(spec),
                         worker=None if spec.worker_cls is Teacher else spec.worker_cls)


def _cost_model(spec: RoleSpec) -> RoleConfig:
    section = _reward_model_section(spec)
    return RoleConfig(model_path=section.model_path, engine=section.engine, device_map=section.device_map)
