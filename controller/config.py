"""The training job's configuration: typed dataclasses are the one source of truth.

YAML files (examples/*.yaml) hold values; ``key.sub=value`` overrides on the
command line change them; ``load_config`` builds the typed tree and
``check_config`` lists every cross-field problem at once, before any process
starts::

    config = load_config("examples/ppo_tiny.yaml", ["algorithm.name=grpo", "rollout.sampling.n=4"])
    check_config(config)   # raises ConfigError with one line per problem
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.algorithms.config import AlgorithmConfig, RolloutCorrectionConfig
from controller.algorithms.presets import PRESETS
from controller.errors import ConfigError
from controller.typed_tree import apply_overrides, build, config_to_dict, read_config_values
from controller.runtime.placement import ClusterNode
from workers.actor import PPOActorConfig
from workers.critic import CriticConfig
from workers.megatron.config import EngineConfig, OptimConfig
from workers.megatron.lora import LoRAConfig
from workers.reward.judge import JudgeConfig
from workers.rollout.config import RolloutConfig
from workers.sandbox.config import SandboxConfig

__all__ = [
    "ALGORITHMS", "AlgorithmConfig", "ConfigError", "DATA_TASKS", "DataConfig", "RLConfig", "RoleConfig", "TrainerConfig",
    "RewardConfig", "RolloutCorrectionConfig", "SandboxConfig", "apply_overrides", "build_section", "check_config",
    "config_from_dict", "config_to_dict", "load_config",
]

# The built-in algorithms (their presets: controller.algorithms.presets); a user's are registered by name
# (controller.algorithms.register_algorithm) or given as a module:Class import path.
ALGORITHMS = tuple(PRESETS)


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
    # a vision-language actor: its vision tower and merger keep their weights (as the peers default); false:
    # they train with the language model
    freeze_vision_tower: bool = True

    def __post_init__(self) -> None:
        if self.device_map not in (None, "auto"):
            raise ValueError(f"device_map {self.device_map!r} is not supported; valid: 'auto' or null")


@dataclass(frozen=True)
class RewardConfig:
    """How responses are scored: a rule function, a reward model, or your own worker; and a generative judge."""

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
    # A generative judge (workers.reward.judge): an LLM that writes a verdict on each response, parsed into a
    # score; alone (fn null) or added to a rule's at its weight, or routed by data_source (controller.rl.judge_scores)
    judge: JudgeConfig | None = None


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
    # a vision-language row's images: datasets Image structs ({"bytes": ...} / {"path": ...}), PIL images or
    # paths, one per <image> placeholder in its prompt
    image_key: str = "images"
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
    # phases on disjoint Ray pools run at the same time (the values beside the old log-probs, the critic's update
    # beside the actor's); false: one after another, today's order, the same results (controller.rl.phase_flow)
    overlap: bool = True
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
    # The sections of registered roles (controller.rl.role_registry), each under its role's name in YAML
    roles: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def split_section(cls, value: dict[str, Any], where: str, build: Callable[[Any, Any, str], Any]) -> dict[str, Any]:
        """The top-level mapping with each registered role's section (a key named as the role) typed into
        ``roles`` (a section given as null: no such role); other keys as they are."""
        from controller.rl.role_registry import ROLE_TYPES

        own = [k for k in value if k in ROLE_TYPES]
        if not own and not value.get("roles"):
            return value
        given = {**(value.get("roles") or {}), **{k: value[k] for k in own}}  # roles: {name: section} too
        roles = {k: build(ROLE_TYPES[k].section, v, k) if k in ROLE_TYPES and isinstance(v, dict) else v
                 for k, v in given.items() if v is not None}
        return {**{k: v for k, v in value.items() if k not in own}, "roles": roles}


# ------------------------------------------------------------------ dict <-> typed tree (controller.typed_tree)
def config_from_dict(values: dict[str, Any]) -> RLConfig:
    return build(RLConfig, values, "")


def build_section(cls: Any, value: Any, where: str) -> Any:
    """``value`` (a mapping) as the config section ``cls``; ConfigError naming ``where`` and the key."""
    return build(cls, value, where)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RLConfig:
    return config_from_dict(read_config_values(path, overrides))


# ------------------------------------------------------------------ cross-field checks (controller.checks)
def check_config(config: RLConfig, model_spec=None, cluster: list[ClusterNode] | None = None,
                 reward_spec=None) -> None:
    """Raise ConfigError listing every problem (each feature's checks: ``controller.checks``, one list).

    ``model_spec`` (the policy's ModelSpec) enables the model checks, of the actor and of a critic made
    from the policy; ``reward_spec`` those of the reward model; ``cluster`` (the Ray cluster's nodes)
    the check that the job's pools fit it.
    """
    from controller.checks import run_checks

    problems = run_checks(config, model_spec, cluster, reward_spec)
    if problems:
        raise ConfigError("the configuration cannot run:\n  - " + "\n  - ".join(problems))
