"""The training job's configuration: typed dataclasses are the one source of truth.

YAML files (examples/*.yaml) hold values; ``key.sub=value`` overrides on the
command line change them; ``load_config`` builds the typed tree and
``check_config`` lists every cross-field problem at once, before any process
starts::

    config = load_config("examples/ppo_tiny.yaml", ["algorithm.name=grpo", "rollout.sampling.n=4"])
    check_config(config)   # raises ConfigError with one line per problem
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from controller.algorithms.config import AlgorithmConfig, RolloutCorrectionConfig
from controller.algorithms.presets import PRESETS
from controller.errors import ConfigError
from controller.runtime.placement import ClusterNode, PlacementError, PoolShape, fit_pools, pool_shape
from workers.actor import PPOActorConfig
from workers.critic import CriticConfig
from workers.megatron.config import PRECISIONS, EngineConfig, OptimConfig
from workers.megatron.lora import LoRAConfig
from workers.rollout.config import RolloutConfig
from workers.rollout.generator import GeneratorTraits, generator_traits, registered_generators
from workers.sandbox.config import SandboxConfig
from workers.rollout.agreement import OLD_LOG_PROB_SOURCES

__all__ = [
    "ALGORITHMS", "AlgorithmConfig", "ConfigError", "DATA_TASKS", "DataConfig", "RLConfig", "RoleConfig", "TrainerConfig",
    "RewardConfig", "RolloutCorrectionConfig", "SandboxConfig", "apply_overrides", "build_section", "check_config",
    "config_from_dict", "config_to_dict", "job_pools", "load_config", "model_split_problem", "uses_sandbox",
]

# The built-in algorithms (their presets: controller.algorithms.presets); a user's are registered by name
# (controller.algorithms.register_algorithm) or given as a module:Class import path.
ALGORITHMS = tuple(PRESETS)
LAUNCHERS = ("torchrun", "ray")


@dataclass(frozen=True)
class RoleConfig:
    """A model role on the megatron engine: where its weights come from and how it is split."""

    model_path: str | None = None  # None: the actor's (the critic: a value model made from it)
    engine: EngineConfig = field(default_factory=EngineConfig)  # its TP / PP split, precision and micro-batches
    optim: OptimConfig = field(default_factory=OptimConfig)  # its optimizer (trained roles only: actor, critic)
    # "auto": the planner's fastest TP x PP that fits the job's devices (controller.planner.device_map); an
    # engine TP or PP other than 1 still wins
    device_map: str | None = None
    # "package.module:Class" or a class: a subclass of the role's worker (Actor, Critic, ReferencePolicy) to run
    worker: str | type | None = None
    # LoRA adapters trained on the frozen base (trained roles: actor, critic); rank 0: every weight trains
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.device_map not in (None, "auto"):
            raise ValueError(f"device_map {self.device_map!r} is not supported; valid: 'auto' or null")


@dataclass(frozen=True)
class RewardConfig:
    """How responses are scored: a rule function, a reward model, or your own worker."""

    # "auto": a scorer per sample's data_source (workers.reward.router); or a built-in name, or
    # "package.module:function" taking (prompt, response, ground_truth, extra, **kwargs) (from Python: the
    # function itself); None with model_path or worker set
    fn: str | Callable | None = "auto"
    model_path: str | None = None  # an HF sequence-classification checkpoint: the RewardModel worker
    # The reward model's own split (its own process groups, whatever the actor's); forward only, so no optim.
    # A model megatron cannot hold runs in transformers (HFRewardModel): engine.precision and micro_batch_size.
    engine: EngineConfig = field(default_factory=EngineConfig)
    device_map: str | None = None  # "auto": the megatron reward model's TP x PP for the job's devices
    max_length: int | None = None  # HFRewardModel: its tokens per text at most (None: the model's limit)
    kwargs: dict[str, Any] = field(default_factory=dict)  # the reward function's keyword arguments
    # samples a rule reward scores at once (threads); None: 8 for the rewards that run code in the sandbox,
    # else 1 (one after another)
    max_concurrency: int | None = None
    # a rule reward's call on one sample at most (seconds); one past it scores 0 and is counted
    # (reward/timeouts), and the step goes on; None: no limit
    timeout_s: float | None = 120.0
    # Your own worker ("package.module:Class" or a class) with compute_reward(batch) -> token_level_scores,
    # scores; worker_kwargs are its constructor's. Set instead of fn and model_path.
    worker: str | type | None = None
    worker_kwargs: dict[str, Any] = field(default_factory=dict)  # reward.worker's constructor keyword arguments


DATA_TASKS = ("arithmetic", "word_problems", "code_expression", "files", "jsonl")  # "jsonl": the old name of "files"
BUILTIN_DATA_TASKS = ("arithmetic", "word_problems", "code_expression")  # generated, from data.seed


@dataclass(frozen=True)
class DataConfig:
    """The prompts: a built-in generator or files, their columns and chat rendering, and the batch size."""

    # a built-in generator (arithmetic, word_problems, code_expression: "12=" asks for a Python expression
    # printing 12), or "files" (train_files / val_files); None: "files" when train files are given, else
    # "arithmetic"
    task: str | None = None
    # One path or a list (concatenated): .parquet, .jsonl, .json, or a datasets save_to_disk directory.
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()  # validation prompts, in the same forms as train_files
    train_file: str | None = None  # the old spelling of a single train_files path (data.task: jsonl)
    val_file: str | None = None  # the old spelling of a single val_files path
    # verl's row schema; a dotted key reaches into a mapping column.
    prompt_key: str = "prompt"  # a string, or a list of {role, content} chat messages
    answer_key: str | None = None  # None: reward_model.ground_truth, else a plain ground_truth column
    data_source_key: str = "data_source"  # routes the reward when reward.fn is "auto"
    extra_info_key: str = "extra_info"  # a mapping handed to the reward function
    apply_chat_template: bool | str = "auto"  # "auto": when the tokenizer has a chat template
    chat_wrap: bool = False  # a string prompt becomes one user message
    system_prompt: str | None = None  # prepended as a system message to every chat
    filter_overlong_prompts: bool = False  # drop prompts over rollout.max_prompt_length (else: an error)
    cache_dir: str | None = None  # datasets' Arrow cache; None: a temporary directory
    train_size: int = 2048  # built-in tasks: training prompts generated
    val_size: int = 64  # built-in tasks: validation prompts generated (from seed + 1); 0: none
    batch_size: int = 16  # prompts per step (each gets rollout.sampling.n responses)
    shuffle: bool = True  # reshuffle the prompts every epoch (from trainer.seed); false: their given order
    seed: int = 0  # built-in tasks: the generator's seed (the validation prompts' is seed + 1)
    max_operand: int = 9  # arithmetic and code_expression tasks: operands in [0, max_operand]
    steps: int = 2  # word_problems task: operations per problem
    operators: str = "+-*"  # arithmetic and code_expression tasks

    def __post_init__(self) -> None:
        if self.task is None:  # the default follows what the user gave
            object.__setattr__(self, "task", "files" if self.train_paths else "arithmetic")

    @property
    def train_paths(self) -> tuple[str, ...]:
        return self.train_files or ((self.train_file,) if self.train_file else ())

    @property
    def val_paths(self) -> tuple[str, ...]:
        return self.val_files or ((self.val_file,) if self.val_file else ())


@dataclass(frozen=True)
class TrainerConfig:
    """The run: steps, checkpoints, validation, launch and placement, logging, export and the step schedule."""

    # steps the run trains (a step: one batch of data.batch_size); a resumed run goes on up to this total
    total_steps: int = 20
    save_every: int = 0  # 0: only at the end
    val_every: int = 0  # 0: no validation
    val_before_train: bool = False  # validate once before the first step too (logged as step 0)
    # steps in a row whose optimizer steps were skipped (a NaN or Inf loss or gradient) before the job stops
    max_bad_steps: int = 5
    # a worker call that takes longer is a hang: every rank's stack into run_dir/hangs, the rank that never
    # reached the collective named, the run stopped (exit 3); None: 10x the call's slowest recent duration, at
    # least 60 s (1500 s for a call's first time)
    hang_timeout_s: float | None = None
    # after a worker or node dies or a call hangs: tear down, start again on the healthy nodes (Ray: fewer nodes
    # give a smaller data-parallel size, the global batch kept), resume from the newest complete checkpoint; at
    # most this many restarts within restart_window_s, the failure after them stops the job listing them (exit 3)
    max_restarts: int = 0
    restart_window_s: float = 3600.0  # the crash-loop window: max_restarts restarts at most within any such span
    run_dir: str | None = "runs/hybridflow"  # None (Python API): no checkpoints unless asked; a temporary work dir
    resume: bool = False  # continue from the newest complete checkpoint under run_dir
    launcher: str = "torchrun"  # what starts the worker processes: "torchrun" or "ray"
    nproc: int = 4  # processes per node (torchrun's --nproc-per-node; one per GPU)
    nnodes: int = 1  # nodes of the job's default pool: nnodes x nproc processes
    ray_address: str | None = None  # launcher ray: null starts a private local cluster; "auto" or "host:port" joins one
    rdzv_endpoint: str | None = None  # launcher torchrun, nnodes > 1: the c10d rendezvous "host:port" every node uses
    logger: tuple[str, ...] = ("console", "jsonl", "tensorboard")  # metrics backends (wandb too, when installed)
    # role -> its own pool (Ray): processes on one node (an int) or {nodes: N, processes_per_node: P}, or another
    # placed role's name to share its pool; roles not named share the default pool (nnodes x nproc)
    placement: dict[str, Any] = field(default_factory=dict)
    export_hf: bool = True  # write the trained actor as an HF checkpoint at the end
    export_precision: str | None = None  # its dtype: "bf16" or "fp32"; None: the actor's engine.precision
    plots: bool = True  # write PNG curves of the metrics at the end
    seed: int = 0  # the prompts' (SFT: examples') order each epoch; RL: each step's sampling seed too
    verbose: bool = False  # true: every library's INFO lines and warnings too (workers.console)
    # sync: generate each step's batch, then train on it; one_step_off: the rollout (on a pool of its own,
    # trainer.placement.rollout) generates step k+1 while step k trains; async: it generates a stream of
    # samples, interrupted by each weight update at a chunk boundary (controller.rl.schedules)
    mode: str = "sync"
    max_staleness: int = 1  # samples more updates stale than this are not trained on (counted)
    # async: tokens per sample per rollout call, where weight updates may interrupt; null: whole responses
    partial_rollout_tokens: int | None = None
    max_in_flight: int | None = None  # async: prompt groups in generation at once; null: what max_staleness allows
    # each step's samples (text, score, per-token mask, rewards, returns, advantages) as {dir}/{step}.jsonl
    rollout_data_dir: str | None = None
    # {field: the rollout's name}: the fields the rollout must produce (DataProto(field="name", ...)), checked
    # before step 1 and on the first batch
    rollout_proto: dict[str, str] | None = None
    log_phases: bool = False  # one console line per phase of each step (RLTrainer(verbose=True))
    # GPU jobs: refuse before launch one the planner predicts will not fit its devices' memory (its pools,
    # register_placement's included, and layouts); false (hybridflow train --force) launches it anyway
    memory_check: bool = True


@dataclass(frozen=True)
class RLConfig:
    """An RL job (hybridflow train): the policy and its roles, rollout, reward, algorithm, data and trainer."""

    model_path: str = "builtin:tiny-arithmetic"  # an HF dir, or builtin:<name> made on the spot
    actor: RoleConfig = field(default_factory=RoleConfig)  # the policy being trained
    ppo: PPOActorConfig = field(default_factory=PPOActorConfig)  # the actor's PPO update
    critic: RoleConfig = field(default_factory=RoleConfig)  # the value model, used when the estimator is GAE
    critic_ppo: CriticConfig = field(default_factory=CriticConfig)  # the critic's update
    ref_policy: RoleConfig | None = None  # None: the actor's model and engine, where a KL term reads a reference
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # response generation
    reward: RewardConfig = field(default_factory=RewardConfig)  # how responses are scored
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # the RL algorithm and its settings
    data: DataConfig = field(default_factory=DataConfig)  # the prompts
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the run: steps, checkpoints, launch, logging
    cost_model: RoleConfig | None = None  # Safe-RLHF: a reward model scoring cost (instead of safe_rlhf_cost_fn)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where model-written code runs


# ------------------------------------------------------------------ dict <-> typed tree
def _build(cls: Any, value: Any, where: str) -> Any:
    """``value`` (from YAML) as type ``cls``; errors name the dotted key."""
    origin = typing.get_origin(cls)
    if dataclasses.is_dataclass(cls):
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where or 'config'}: expected a mapping of {cls.__name__} fields, got {value!r}")
        if hasattr(cls, "split_section"):  # a section whose keys a part of it owns (an algorithm's own settings)
            value = cls.split_section(value, where, _build)
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ConfigError(f"{where or 'config'}: unknown key(s) {unknown}; valid keys: {sorted(fields)}")
        kwargs = {k: _build(hints[k], v, f"{where}.{k}" if where else k) for k, v in value.items()}
        try:
            return cls(**kwargs)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where or 'config'}: {exc}") from None
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(cls)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _build(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: cannot be {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]
        inner = typing.get_args(cls)[0]
        return tuple(_build(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or cls is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if cls is Any:
        return value
    if origin is collections.abc.Callable:
        if not callable(value):
            raise ConfigError(f"{where}: expected a function, got {value!r}")
        return value
    if cls is type:
        if not isinstance(value, type):
            raise ConfigError(f"{where}: expected a class, got {value!r}")
        return value
    if cls is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if cls is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if cls is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if cls is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def config_from_dict(values: dict[str, Any]) -> RLConfig:
    return _build(RLConfig, values, "")


def build_section(cls: Any, value: Any, where: str) -> Any:
    """``value`` (a mapping) as the config section ``cls``; ConfigError naming ``where`` and the key."""
    return _build(cls, value, where)


def config_to_dict(config: Any) -> Any:
    if dataclasses.is_dataclass(config):
        return {f.name: config_to_dict(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}
    if isinstance(config, tuple):
        return [config_to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: config_to_dict(v) for k, v in config.items()}
    if callable(config):  # a function or class given from Python: its import path, as YAML names it
        return f"{config.__module__}:{config.__qualname__}"
    return config


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key.sub=value`` strings applied to a nested dict; values are parsed as YAML scalars/lists."""
    values = yaml.safe_load(yaml.safe_dump(values)) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        node = values
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
    return values


def read_config_values(path: str | Path | None, overrides: list[str] | None) -> dict[str, Any]:
    """A YAML file's mapping (None: empty) with ``key.sub=value`` overrides applied."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path} must hold a mapping at the top level, got {type(values).__name__}")
    return apply_overrides(values, overrides or [])


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RLConfig:
    return config_from_dict(read_config_values(path, overrides))


# ------------------------------------------------------------------ cross-field checks
PLACEABLE_ROLES = ("actor", "rollout", "critic", "ref_policy", "reward_model", "reward")


def job_pools(trainer: TrainerConfig) -> dict[str, PoolShape]:
    """The job's pools: "default" (nnodes x nproc) and one per placed role; PlacementError on a bad entry.

    An entry that names another placed role (``trainer.placement={critic: 4, reward_model: critic}``)
    shares that role's pool: both map to the same ``PoolShape``, named after the role that owns it.
    """
    pools = {"default": PoolShape("default", trainer.nnodes, trainer.nproc)}
    for role, value in trainer.placement.items():
        if role not in PLACEABLE_ROLES:
            raise PlacementError(f"trainer.placement: {role!r} is not a placeable role; valid: {PLACEABLE_ROLES}")
        if not isinstance(value, str):
            pools[role] = pool_shape(role, value, f"trainer.placement.{role}")
    for role, value in trainer.placement.items():
        if isinstance(value, str):
            owners = sorted(r for r, v in trainer.placement.items() if not isinstance(v, str))
            if value not in owners:
                raise PlacementError(f"trainer.placement.{role}: {value!r} names no role placed on a pool of its own; "
                                     f"name one of {owners}, or give a number of processes or "
                                     "{nodes, processes_per_node}")
            if "rollout" in (role, value):
                raise PlacementError(f"trainer.placement.{role}: {value!r}: a rollout on its own pool shares it with "
                                     "no other role (it sits with the actor when not placed)")
            pools[role] = pools[value]
    return pools


def distinct_pools(pools: dict[str, PoolShape]) -> list[PoolShape]:
    """Each pool once (roles sharing a pool map to one shape)."""
    return list({shape.name: shape for shape in pools.values()}.values())


def _schedule_problems(trainer: TrainerConfig, alg: AlgorithmConfig, rollout: RolloutConfig) -> list[str]:
    from controller.rl.schedules import TRAINER_MODES

    if trainer.mode not in TRAINER_MODES:
        return [f"trainer.mode {trainer.mode!r} is not one of {TRAINER_MODES}"]
    problems = []
    if trainer.max_staleness < 0:
        problems.append(f"trainer.max_staleness must be >= 0, got {trainer.max_staleness}")
    mode = f"trainer.mode {trainer.mode}"
    if trainer.mode != "async":
        problems += [f"trainer.{key} is a setting of trainer.mode async (this run is {trainer.mode}); drop it"
                     for key in ("partial_rollout_tokens", "max_in_flight") if getattr(trainer, key) is not None]
    if trainer.mode != "sync":
        if "rollout" not in trainer.placement:
            problems.append(f"{mode} overlaps generation with training: give the rollout a pool "
                            f"of its own (trainer.placement.rollout, with trainer.launcher=ray)")
        if alg.name == "dapo" and alg.dynamic_sampling is not False:
            problems.append(f"{mode} does not yet run DAPO's dynamic sampling (its extra generation rounds "
                            f"within a step); set algorithm.dynamic_sampling=false or trainer.mode=sync")
    if trainer.mode == "one_step_off" and trainer.max_staleness < 1:
        problems.append(f"trainer.mode one_step_off trains on samples one update stale: trainer.max_staleness "
                        f"must be >= 1, got {trainer.max_staleness}")
    if trainer.mode == "async":
        tokens, limit = trainer.partial_rollout_tokens, rollout.sampling.max_new_tokens
        if tokens is not None and not (isinstance(tokens, int) and 1 <= tokens <= limit):
            problems.append(f"trainer.partial_rollout_tokens must be an integer in [1, rollout.sampling.max_new_tokens="
                            f"{limit}] (tokens per sample per rollout call), got {tokens!r}")
        if trainer.max_in_flight is not None and not (isinstance(trainer.max_in_flight, int) and trainer.max_in_flight >= 1):
            problems.append(f"trainer.max_in_flight must be a positive integer (prompt groups in generation at once) "
                            f"or null, got {trainer.max_in_flight!r}")
        if rollout.serves_agent:
            problems += [f"trainer.{key} is a setting of the built-in async stream; a served agent's requests take "
                         f"new weights in flight (rollout.server_update: pause or finish): drop it"
                         for key in ("partial_rollout_tokens", "max_in_flight") if getattr(trainer, key) is not None]
            if rollout.lora_sync == "adapter" and rollout.server_update == "pause":
                problems.append("rollout.lora_sync adapter with rollout.server_update pause: vLLM cannot move a request "
                                "in flight onto a new LoRA adapter; use server_update: finish (the requests in flight "
                                "end on the adapter they started with) or lora_sync: merge")
        elif rollout.agent is not None:
            problems.append("trainer.mode async continues single-turn responses across weight updates; built-in "
                            "multi-turn (rollout.agent) conversations run with trainer.mode sync or one_step_off, "
                            "and your own agent (rollout.agent.entrypoint, on rollout.server) with any mode")
    return problems


def _needs_critic(alg) -> bool:
    try:
        return alg.needs_critic
    except ValueError:  # an unknown algorithm, listed elsewhere
        return False


def lora_problems(roles: dict[str, tuple[Any, Any]]) -> list[str]:
    """``role.lora`` of each role (key -> (its RoleConfig or None, its ModelSpec or None)): a role that trains
    (actor, critic), targets and a rank the model takes (``check_lora``), an adapter directory that exists."""
    from workers.megatron.lora import check_lora

    problems = []
    for key, (role, spec) in roles.items():
        lora = getattr(role, "lora", None)
        if lora is None or not lora.enabled:
            continue
        if key not in ("actor", "critic"):
            problems.append(f"{key}.lora: LoRA trains adapters, and the {key} does not train; only actor.lora and "
                            f"critic.lora are valid (a LoRA actor's reference is its base, the adapters off)")
            continue
        if lora.adapter_path is not None and not (Path(lora.adapter_path) / "adapter_config.json").is_file():
            problems.append(f"{key}.lora.adapter_path {lora.adapter_path!r} is not a PEFT adapter directory (no "
                            f"adapter_config.json)")
        elif lora.adapter_path is not None:
            from workers.megatron.lora_peft import peft_adapter_problems

            saved = json.loads((Path(lora.adapter_path) / "adapter_config.json").read_text())
            problems += [f"{key}.{problem}" for problem in peft_adapter_problems(saved, lora.adapter_path)]
        if spec is not None:
            try:
                check_lora(spec, lora)
            except ValueError as exc:
                problems.append(f"{key}.lora: {exc}")
    return problems


def _router_replay_problems(config: RLConfig, model_spec) -> list[str]:
    """algorithm.router_replay: a known mode, a mixture of experts, and a rollout that can report its routes."""
    from controller.algorithms.config import ROUTER_REPLAY_MODES

    mode, rollout, trainer = config.algorithm.router_replay, config.rollout, config.trainer
    if mode not in ROUTER_REPLAY_MODES:
        return [f"algorithm.router_replay {mode!r} is not one of {ROUTER_REPLAY_MODES}"]
    if mode == "off":
        return []
    problems = []
    setting = f"algorithm.router_replay {mode}"
    if model_spec is not None and model_spec.moe is None:
        problems.append(f"{setting} is for mixtures of experts; {model_spec.architecture} has no router")
    if rollout.agent is not None:
        problems.append(f"{setting}: multi-turn (rollout.agent) rollouts do not carry their routes yet; use "
                        f"single-turn rollouts or algorithm.router_replay=off")
    if trainer.mode == "async":
        problems.append(f"{setting}: trainer.mode async continues responses across weight updates, whose "
                        f"routes are not carried over yet; use trainer.mode sync or one_step_off")
    if mode == "rollout" and config.actor.engine.recompute_granularity == "full":
        problems.append(f"{setting} with actor.engine.recompute_granularity 'full': the recomputed forward would "
                        f"route afresh; use 'selective' or none")
    if mode == "rollout" and config.actor.engine.moe_capacity_factor is not None:
        problems.append(f"{setting} with actor.engine.moe_capacity_factor {config.actor.engine.moe_capacity_factor}: "
                        f"the capacity would drop replayed tokens that the rollout's experts computed; use "
                        f"moe_capacity_factor null (dropless) or algorithm.router_replay measure")
    return problems


def trainer_problems(trainer: TrainerConfig) -> list[str]:
    """The trainer section on its own: export precision, launcher, counts, and the launch addresses."""
    problems = []
    if trainer.export_precision is not None and trainer.export_precision not in PRECISIONS:
        problems.append(f"trainer.export_precision {trainer.export_precision!r} is not one of {sorted(PRECISIONS)} "
                        "or null (the actor's engine.precision)")
    if trainer.launcher not in LAUNCHERS:
        problems.append(f"trainer.launcher {trainer.launcher!r} is not one of {LAUNCHERS}")
    for name in ("total_steps", "nproc", "nnodes", "max_bad_steps"):
        if getattr(trainer, name) < 1:
            problems.append(f"trainer.{name} must be >= 1, got {getattr(trainer, name)}")
    if trainer.hang_timeout_s is not None and not trainer.hang_timeout_s > 0:
        problems.append(f"trainer.hang_timeout_s must be a positive number of seconds or null (from each call's "
                        f"own durations), got {trainer.hang_timeout_s!r}")
    for name in ("save_every", "val_every", "max_restarts"):
        if getattr(trainer, name) < 0:
            problems.append(f"trainer.{name} must be >= 0 (0 turns it off), got {getattr(trainer, name)}")
    if not trainer.restart_window_s > 0:
        problems.append(f"trainer.restart_window_s must be a positive number of seconds, got {trainer.restart_window_s!r}")
    if trainer.max_restarts and trainer.run_dir is None:
        problems.append(f"trainer.max_restarts={trainer.max_restarts} needs a trainer.run_dir to resume from")
    return problems + _launch_problems(trainer)


def _launch_problems(trainer: TrainerConfig) -> list[str]:
    problems = []
    if trainer.ray_address is not None and trainer.launcher != "ray":
        problems.append(f"trainer.ray_address {trainer.ray_address!r} needs trainer.launcher=ray "
                        f"(it is {trainer.launcher!r})")
    if trainer.ray_address is not None and trainer.ray_address != "auto" and not _is_host_port(trainer.ray_address):
        problems.append(f"trainer.ray_address must be null (a private local cluster), 'auto' or 'host:port', "
                        f"got {trainer.ray_address!r}")
    if trainer.rdzv_endpoint is not None and not _is_host_port(trainer.rdzv_endpoint):
        problems.append(f"trainer.rdzv_endpoint must be 'host:port', got {trainer.rdzv_endpoint!r}")
    if trainer.rdzv_endpoint is not None and trainer.launcher != "torchrun":
        problems.append("trainer.rdzv_endpoint is torchrun's rendezvous; with trainer.launcher=ray the nodes "
                        "join the Ray cluster at trainer.ray_address instead")
    return problems


def _response_limit(rollout: RolloutConfig) -> str:
    """The key that bounds a response: one reply's max_new_tokens, or a whole conversation's."""
    return "agent.max_response_length" if rollout.agent is not None else "max_new_tokens"


def _is_host_port(value: str) -> bool:
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def model_split_problem(key: str, spec: Any, engine: EngineConfig) -> str | None:
    """Why the model (its ``ModelSpec``) cannot be split as ``engine`` says, its vocabulary padded for
    the TP size; None when it can. ``key`` names the role in the message."""
    try:
        padded = spec.with_padded_vocab(engine.make_vocab_size_divisible_by, engine.tensor_parallel)
        padded.check_layout(engine.tensor_parallel, engine.pipeline_parallel, engine.expert_parallel,
                            engine.expert_tensor_parallel)
    except ValueError as exc:
        return f"{key}: {exc}"
    return None


def check_config(config: RLConfig, model_spec=None, cluster: list[ClusterNode] | None = None,
                 reward_spec=None) -> None:
    """Raise ConfigError listing every problem.

    ``model_spec`` (the policy's ModelSpec) enables the model checks, of the actor and of a critic made
    from the policy; ``reward_spec`` those of the reward model; ``cluster`` (the Ray cluster's nodes)
    the check that the job's pools fit it.
    """
    from hybridengine.cross_pool.plan import plan_cross_pool
    from hybridengine.parallel.layout import ParallelLayout
    from hybridengine.reshard.plan import (
        GenerationLayout,
        ReshardLayoutError,
        plan_reshard,
    )
    from hybridengine.reshard.expert_plan import check_expert_split
    from hybridengine.reshard.weight_plan import plan_weights, refuse_routed_experts

    problems: list[str] = []
    alg, trainer, rollout, data = config.algorithm, config.trainer, config.rollout, config.data
    n = rollout.sampling.n
    role_specs = {"actor": model_spec, "critic": model_spec if config.critic.model_path is None else None,
                  "reward.engine": reward_spec}
    problems += _algorithm_problems(config)
    if alg.old_log_prob_source not in OLD_LOG_PROB_SOURCES:
        problems.append(f"algorithm.old_log_prob_source {alg.old_log_prob_source!r} is not one of {OLD_LOG_PROB_SOURCES}")
    problems += trainer_problems(trainer)
    problems += _schedule_problems(trainer, alg, rollout)
    problems += _router_replay_problems(config, model_spec)
    if rollout.agent is not None and rollout.agent.entrypoint is not None:
        from controller.serving.user_agents import load_agent

        try:
            load_agent(rollout.agent.entrypoint)
        except ValueError as exc:
            problems.append(str(exc))
    if rollout.lora_sync == "adapter" and not config.actor.lora.enabled:
        problems.append("rollout.lora_sync 'adapter' serves a LoRA actor's adapters, and actor.lora.rank is 0")
    traits = generator_traits(rollout.engine) if rollout.engine in registered_generators() else GeneratorTraits()
    if rollout.lora_sync == "adapter" and traits.serves_adapters:
        if config.actor.lora.rank > traits.max_adapter_rank:
            problems.append(f"rollout.lora_sync 'adapter': {rollout.engine} serves LoRA ranks up to "
                            f"{traits.max_adapter_rank}, and actor.lora.rank is {config.actor.lora.rank}; use "
                            f"rollout.lora_sync: merge (or auto)")
    problems += lora_problems({"actor": (config.actor, model_spec),
                               "critic": (config.critic, role_specs["critic"] if _needs_critic(alg) else None),
                               "ref_policy": (config.ref_policy, None)})
    pools = {}
    try:
        pools = job_pools(trainer)
    except PlacementError as exc:
        problems.append(str(exc))
    if trainer.placement and trainer.launcher == "torchrun":
        problems.append("trainer.placement (split pools) needs trainer.launcher=ray: under torchrun every "
                        "megatron role spans the whole world")
    if cluster is not None and not problems:
        try:
            fit_pools(distinct_pools(pools), cluster)
        except PlacementError as exc:
            problems.append(f"trainer.placement / trainer.nnodes x nproc do not fit the Ray cluster: {exc}")
    if data.batch_size < 1:
        problems.append(f"data.batch_size must be >= 1, got {data.batch_size}")
    problems += _data_problems(data)
    problems += _reward_problems(config)
    problems += _sandbox_problems(config)
    problems += _server_port_problems(rollout)

    # Layouts: each megatron role is its own grid over its pool (colocated roles may differ in TP/PP).
    sequences = data.batch_size * n
    roles = [("actor", "actor", config.actor.engine, config.ppo.ppo_mini_batch_size)]
    try:
        needs_critic = alg.needs_critic
    except ValueError:  # an unknown algorithm, listed above
        needs_critic = False
    if needs_critic:
        roles.append(("critic", "critic", config.critic.engine, config.critic_ppo.ppo_mini_batch_size))
    if config.reward.model_path is not None:
        roles.append(("reward.engine", "reward_model", config.reward.engine, None))  # forward only: no mini-batches
    actor_layout = None
    for key, role, eng, mini in roles:
        mp = eng.tensor_parallel * eng.pipeline_parallel
        if role not in pools and "default" not in pools:
            continue
        world = pools.get(role, pools.get("default")).world_size
        where = (f"trainer.placement.{role}" if role in trainer.placement else "trainer.nproc" if trainer.nnodes == 1
                 else f"trainer.nnodes x nproc = {trainer.nnodes} x {trainer.nproc} =")
        if world % mp:
            problems.append(f"{key}: tensor_parallel x pipeline_parallel = {mp} does not divide {where} {world}")
            continue
        try:
            layout = ParallelLayout.for_world(world, eng.tensor_parallel, eng.pipeline_parallel, eng.expert_parallel,
                                              eng.expert_tensor_parallel)
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
            continue
        if role == "actor":
            actor_layout = layout
        spec = role_specs.get(key)
        if spec is not None and (problem := model_split_problem(key, spec, eng)):
            problems.append(problem)
        if mini is None:
            continue
        if sequences % mini:
            problems.append(f"{role}: a step's {sequences} sequences (data.batch_size {data.batch_size} x n {n}) do not "
                            f"divide into PPO mini-batches of {mini}")
        elif mini % layout.dp:
            problems.append(f"{role}: ppo_mini_batch_size {mini} does not divide over {layout.dp} data-parallel ranks")
        elif (mini // layout.dp) % eng.micro_batch_multiple:
            problems.append(f"{role}: a mini-batch gives each DP rank {mini // layout.dp} sequences, not a multiple of "
                            f"micro_batch_size {eng.micro_batch_size}")
        longest = rollout.max_model_len
        if eng.max_tokens_per_micro_batch is not None and eng.max_tokens_per_micro_batch < longest:
            problems.append(f"{role}: engine.max_tokens_per_micro_batch {eng.max_tokens_per_micro_batch} is below the "
                            f"longest sequence, rollout.max_prompt_length + {_response_limit(rollout)} = {longest}")
    gen = GenerationLayout(rollout.tensor_parallel, rollout.pipeline_parallel, rollout.expert_parallel)
    if actor_layout is not None and "rollout" in pools:  # its own pool, fed across pools by the actor
        world, mp = pools["rollout"].world_size, gen.tensor_parallel * gen.pipeline_parallel
        if world % mp:
            problems.append(f"rollout: tensor_parallel x pipeline_parallel = {mp} does not divide "
                            f"trainer.placement.rollout {world}")
        else:
            try:
                plan_cross_pool(actor_layout, gen, world // mp)
                if model_spec is not None and model_spec.moe is not None:
                    check_expert_split(model_spec, gen)
                    refuse_routed_experts(model_spec, rollout.engine, gen, traits.experts_at_tensor_parallel)
            except ReshardLayoutError as exc:
                problems.append(f"rollout: {exc}")
    elif actor_layout is not None:
        try:
            if model_spec is None:
                plan_reshard(actor_layout, gen)
            else:  # the actor's shards, padded as its engine pads them, planned into the generation layout
                actor = config.actor.engine
                plan_weights(model_spec.with_padded_vocab(actor.make_vocab_size_divisible_by, actor.tensor_parallel),
                             actor_layout, gen)
                refuse_routed_experts(model_spec, rollout.engine, gen, traits.experts_at_tensor_parallel)
        except ValueError as exc:  # ReshardLayoutError, or a split the model's heads do not allow
            problems.append(f"rollout: {exc}")
    if model_spec is not None:
        longest = rollout.max_model_len
        if longest > model_spec.max_position_embeddings:
            problems.append(f"rollout: max_prompt_length {rollout.max_prompt_length} + {_response_limit(rollout)} "
                            f"{rollout.max_response_length} = {longest} exceeds the model's "
                            f"max_position_embeddings {model_spec.max_position_embeddings}")
    if problems:
        raise ConfigError("the configuration cannot run:\n  - " + "\n  - ".join(problems))


def _algorithm_problems(config: RLConfig) -> list[str]:
    """The algorithm found (an import path imported now), its estimator registered, its settings in range."""
    from controller.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from controller.algorithms.algorithm import ALGORITHMS as REGISTERED
    from controller.algorithms.algorithm import resolve_algorithm, resolve_rollout_correction
    from controller.algorithms.dapo import DAPO
    from workers.policy_losses import KL_ESTIMATOR_NAMES

    alg, n, max_new = config.algorithm, config.rollout.sampling.n, config.rollout.sampling.max_new_tokens
    try:
        cls, _ = resolve_algorithm(alg.name)
    except ValueError as exc:
        if ":" in alg.name:
            return [str(exc)]
        return [f"algorithm.name {alg.name!r} is not one of the registered algorithms {sorted(REGISTERED)} "
                "(or a module:Class import path)"]
    problems = []
    if not alg.estimator:
        problems.append(f"algorithm.name {alg.name!r} needs algorithm.advantage_estimator (a registered estimator: "
                        f"{sorted(ADVANTAGE_ESTIMATORS)})")
    elif alg.estimator not in ADVANTAGE_ESTIMATORS:
        problems.append(f"advantage estimator {alg.estimator!r} is not registered; registered: {sorted(ADVANTAGE_ESTIMATORS)}")
    if alg.estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and n < 2:
        problems.append(f"{alg.estimator} compares samples of one prompt: rollout.sampling.n must be >= 2, got {n}")
    if not issubclass(cls, DAPO):
        for key in ("dynamic_sampling", "overlong_buffer_len"):
            if getattr(alg, key) is not None:
                problems.append(f"algorithm.{key} is a DAPO setting; algorithm.name is {alg.name!r} (use dapo)")
    if alg.max_gen_batches < 1:
        problems.append(f"algorithm.max_gen_batches must be >= 1 (the first generation included), got {alg.max_gen_batches}")
    if alg.overlong_buffer_len is not None and not 0 <= alg.overlong_buffer_len <= max_new:
        problems.append(f"algorithm.overlong_buffer_len must be in [0, rollout.sampling.max_new_tokens = {max_new}], "
                        f"got {alg.overlong_buffer_len}")
    if isinstance(alg.kl_penalty, str) and alg.kl_penalty not in KL_ESTIMATOR_NAMES:
        problems.append(f"algorithm.kl_penalty {alg.kl_penalty!r} is not one of {KL_ESTIMATOR_NAMES}")
    try:
        resolve_rollout_correction(alg.rollout_correction, same_precision=False)
    except ValueError as exc:
        problems.append(f"algorithm.rollout_correction: {exc}")
    return problems


def _data_problems(data: DataConfig) -> list[str]:
    from controller.data.arithmetic import ARITHMETIC_OPERATORS
    from controller.data.chat_template import apply_chat_template_problem

    problems = []
    if data.task not in DATA_TASKS:
        return [f"data.task {data.task!r} is not one of {DATA_TASKS} ('jsonl' is the old name of 'files')"]
    for old, new in (("train_file", "train_files"), ("val_file", "val_files")):
        if getattr(data, old) and getattr(data, new):
            problems.append(f"data.{old} and data.{new} are both set; give the paths once, in data.{new}")
    if data.task in BUILTIN_DATA_TASKS:
        if data.train_paths or data.val_paths:
            problems.append(f"data.train_files / val_files are set but data.task is {data.task!r} (the built-in "
                            "generator); set data.task=files to train on them")
        if data.task == "word_problems" and data.steps < 1:
            problems.append(f"data.steps must be >= 1 (operations per word problem), got {data.steps}")
        if data.train_size < 1 or data.val_size < 0:
            problems.append(f"data.train_size must be >= 1 and data.val_size >= 0, got {data.train_size}, {data.val_size}")
        if not data.operators or set(data.operators) - set(ARITHMETIC_OPERATORS):
            problems.append(f"data.operators {data.operators!r}: each must be one of {ARITHMETIC_OPERATORS!r}")
    elif not data.train_paths:
        problems.append(f"data.task {data.task!r} needs data.train_file or data.train_files (one path or a list)"
                        if data.task == "jsonl" else "data.task 'files' needs data.train_files (one path or a list)")
    for path in (*data.train_paths, *data.val_paths):
        if not Path(path).exists():
            problems.append(f"data: prompt file {path} does not exist")
    if problem := apply_chat_template_problem(data.apply_chat_template):
        problems.append(problem)
    return problems


def uses_sandbox(config: RLConfig) -> bool:
    """Whether the job runs model-written code by a built-in: a reward (named, or the code_expression task's
    scorer under reward.fn auto) or an agent tool. A user's function calling the sandbox itself is refused
    at its first run instead, on a machine that cannot isolate."""
    from workers.rollout.agent.python_tool import PythonTool
    from workers.sandbox import SANDBOX_REWARDS, SANDBOX_TOOLS

    reward = config.reward
    by_fn = reward.model_path is None and reward.worker is None
    if by_fn and (reward.fn in SANDBOX_REWARDS or (reward.fn == "auto" and config.data.task == "code_expression")):
        return True
    if config.algorithm.safe_rlhf_cost_fn in SANDBOX_REWARDS:
        return True
    agent = config.rollout.agent
    if agent is None or agent.entrypoint is not None:
        return False
    for name in agent.tools:
        if name in SANDBOX_TOOLS:
            return True
        try:
            from workers.rollout.agent.config import resolve_tool

            if issubclass(resolve_tool(name), PythonTool):
                return True
        except ValueError:  # reported by the rollout's own check
            continue
    return False


def _server_port_problems(rollout: RolloutConfig) -> list[str]:
    """A rollout server whose fixed port is taken (the endpoint runs on the controller's node, where this runs)."""
    import socket

    if not rollout.server or not rollout.server_port:
        return []
    try:
        with socket.socket(socket.AF_INET6 if ":" in rollout.server_host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((rollout.server_host, rollout.server_port))
    except OSError as exc:
        reason = exc.strerror or exc
        return [f"rollout.server_port {rollout.server_port} on {rollout.server_host} cannot be bound ({reason}): "
                f"another process holds it; choose a free port, or 0 for any free one"]
    return []


def _sandbox_problems(config: RLConfig) -> list[str]:
    """A job that runs code where the sandbox cannot isolate it is refused, unless limits-only is said."""
    from workers.sandbox import isolation_problem

    if not uses_sandbox(config):
        return []
    problem = isolation_problem(config.sandbox.isolation)
    return [f"sandbox: {problem}"] if problem else []


def _reward_problems(config: RLConfig) -> list[str]:
    """Reward and cost functions found and their signatures bound now, not in a worker after start-up."""
    from workers.reward.router import check_reward_fn

    reward, alg = config.reward, config.algorithm
    problems = []
    if reward.worker is not None and reward.model_path is not None:
        problems.append("reward: reward.worker (your own worker) and reward.model_path (a reward model) are both "
                        "set; give one")
    elif reward.fn is None and reward.model_path is None and reward.worker is None:
        problems.append("reward: set reward.fn (a rule) or reward.model_path (a reward model), or reward.worker "
                        "(your own worker)")
    if reward.timeout_s is not None and not reward.timeout_s > 0:
        problems.append(f"reward.timeout_s must be a positive number of seconds or null (no limit), got "
                        f"{reward.timeout_s!r}")
    if reward.max_concurrency is not None and reward.max_concurrency < 1:
        problems.append(f"reward.max_concurrency must be a positive integer or null, got {reward.max_concurrency!r}")
    by_fn = reward.model_path is None and reward.worker is None and reward.fn is not None
    checks = [("reward.fn", reward.fn)] if by_fn else []
    if alg.safe_rlhf_cost_fn is not None:
        checks.append(("algorithm.safe_rlhf_cost_fn", alg.safe_rlhf_cost_fn))
    for key, spec in checks:
        try:
            check_reward_fn(spec, reward.kwargs if key == "reward.fn" else None, key)
        except ValueError as exc:
            problems.append(str(exc))
    return problems
