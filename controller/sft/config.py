"""The SFT job's configuration (``hybridflow sft``): typed, from YAML and ``key=value`` overrides, checked
before any process starts.

    config = load_sft_config("examples/sft_tiny.yaml", ["trainer.total_steps=50"])
    check_sft_config(config, ModelSpec.from_pretrained(path))   # ConfigError listing every problem

The actor, trainer and launch keys are those of ``hybridflow train`` (``controller.config``); ``data``
is SFT's own: examples instead of prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.checks.layouts import model_split_problem, sequence_layout_problem
from controller.checks.lora import lora_problems
from controller.checks.placement import job_pools
from controller.checks.trainer import trainer_problems
from controller.config import ConfigError, RoleConfig, TrainerConfig
from controller.typed_tree import build, read_config_values

__all__ = ["SFT_FORMATS", "SFT_TASKS", "SFTConfig", "SFTDataConfig", "check_sft_config", "load_sft_config"]

SFT_TASKS = ("arithmetic", "calculator_transcripts", "files")
SFT_FORMATS = ("auto", "pair", "messages", "text")


@dataclass(frozen=True)
class SFTDataConfig:
    """The examples: built-in arithmetic pairs or files, their format and columns, lengths and batch size."""

    # built-in prompt/answer pairs ("7+5=" -> "12"), calculator_transcripts (tool-call chats for the word problems
    # of RL's data.task word_problems: controller.data.tool_transcripts), or "files"; None: files if given
    task: str | None = None
    train_files: tuple[str, ...] = ()  # .parquet, .jsonl, .json or a datasets save_to_disk directory
    val_files: tuple[str, ...] = ()  # validation examples, in the same forms as train_files
    # pair: prompt_key + response_key; messages: a chat, the loss on assistant turns; text: text_key;
    # auto: whichever key a row has (messages, then a prompt/response pair, then text)
    format: str = "auto"
    prompt_key: str = "prompt"  # a string or chat messages (rendered as the rollout renders prompts)
    response_key: str = "response"  # pair: the response string's column
    messages_key: str = "messages"  # messages: the chat's column (a list of {role, content})
    text_key: str = "text"  # text: the plain text's column
    # a vision-language model's images: one per <image> placeholder in the prompt or the chat's user turns
    image_key: str = "images"
    apply_chat_template: bool | str = "auto"  # pairs: "auto" renders the prompt through the tokenizer's template
    chat_wrap: bool = False  # pairs: a string prompt becomes one user message
    system_prompt: str | None = None  # pairs: prepended as a system message to a chat prompt that has none
    max_length: int = 64  # prompt + response tokens at most; longer examples are refused (or dropped)
    drop_overlong: bool = False  # drop examples over max_length instead of refusing them
    batch_size: int = 16  # examples per optimizer step, over all data-parallel ranks
    shuffle: bool = True  # the order of the examples, from trainer.seed (as RL's prompts)
    seed: int = 0  # arithmetic task: the problems drawn (the held-out ones from seed + 1)
    train_size: int = 2048  # arithmetic task
    val_size: int = 64  # arithmetic task: held-out pairs (from seed + 1); 0: none
    max_operand: int = 9  # arithmetic task: operands in [0, max_operand]
    operators: str = "+-*"  # arithmetic task: the operators drawn from
    steps: int = 2  # calculator_transcripts: operations per word problem
    tool_format: str = "hermes"  # calculator_transcripts: how the calls are written (hermes or json)

    def __post_init__(self) -> None:
        if self.task is None:  # the default follows what the user gave
            object.__setattr__(self, "task", "files" if self.train_files else "arithmetic")


@dataclass(frozen=True)
class SFTConfig:
    """An SFT job (hybridflow sft): the model, its engine and optimizer, the examples and the trainer."""

    model_path: str = "builtin:tiny-arithmetic"  # an HF dir, or builtin:<name> made on the spot
    actor: RoleConfig = field(default_factory=RoleConfig)  # the model being fine-tuned
    data: SFTDataConfig = field(default_factory=SFTDataConfig)  # the examples
    # the keys of hybridflow train's trainer (run_dir default: runs/sft); the RL-only ones are refused
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(run_dir="runs/sft"))


def load_sft_config(path: str | Path | None = None, overrides: list[str] | None = None) -> SFTConfig:
    values = read_config_values(path, overrides)
    values.pop("kind", None)  # a run directory's config.yaml says which job wrote it
    if "trainer" in values and "run_dir" not in (values["trainer"] or {}):
        values["trainer"] = {"run_dir": "runs/sft", **values["trainer"]}
    return build(SFTConfig, values, "")


# RL-only trainer settings: an SFT job refuses them rather than ignoring them.
_RL_ONLY = ("val_before_train", "placement", "mode", "max_staleness", "partial_rollout_tokens", "max_in_flight")


def check_sft_config(config: SFTConfig, model_spec=None) -> None:
    """Raise ConfigError listing every problem (``model_spec``: the model's ModelSpec, for its checks)."""
    from hybridengine.parallel.layout import ParallelLayout

    problems: list[str] = []
    data, trainer, engine = config.data, config.trainer, config.actor.engine
    defaults = TrainerConfig()
    for key in _RL_ONLY:
        if getattr(trainer, key) != getattr(defaults, key):
            problems.append(f"trainer.{key} is a setting of RL training (hybridflow train); an SFT job has none: drop it")
    problems += trainer_problems(trainer)
    problems += lora_problems({"actor": (config.actor, model_spec)})
    problems += _sft_data_problems(data, trainer)
    world = trainer.nnodes * trainer.nproc
    mp = engine.tensor_parallel * engine.pipeline_parallel
    if world % mp:
        problems.append(f"actor: tensor_parallel x pipeline_parallel = {mp} does not divide the {world} processes "
                        f"(trainer.nnodes x nproc)")
    elif data.batch_size >= 1:
        try:
            layout = engine.layout(world)
        except ValueError as exc:
            problems.append(f"actor: {exc}")
            layout = ParallelLayout.for_world(world, engine.tensor_parallel, engine.pipeline_parallel)
        replicas = layout.data_replicas
        if data.batch_size % replicas:
            problems.append(f"data.batch_size {data.batch_size} does not divide over {replicas} data-parallel ranks")
        elif (data.batch_size // replicas) % engine.micro_batch_multiple:
            problems.append(f"data.batch_size gives each data-parallel rank {data.batch_size // replicas} examples, "
                            f"not a multiple of actor.engine.micro_batch_size {engine.micro_batch_size}")
    budget = engine.max_tokens_per_micro_batch
    if budget is not None and budget * engine.context_parallel < data.max_length:
        cp = f" x context_parallel {engine.context_parallel}" if engine.context_parallel > 1 else ""
        problems.append(f"actor.engine.max_tokens_per_micro_batch {budget}{cp} is below data.max_length "
                        f"{data.max_length}, the longest example")
    if model_spec is not None:
        if problem := model_split_problem("actor", model_spec, engine):
            problems.append(problem)
        if problem := sequence_layout_problem("actor", model_spec, engine):
            problems.append(problem)
        if data.max_length > model_spec.max_position_embeddings:
            problems.append(f"data.max_length {data.max_length} exceeds the model's max_position_embeddings "
                            f"{model_spec.max_position_embeddings}")
    try:
        job_pools(trainer)
    except Exception as exc:  # a malformed placement entry, listed above as RL-only
        problems.append(str(exc))
    if problems:
        raise ConfigError("the SFT configuration cannot run:\n  - " + "\n  - ".join(problems))


def _sft_data_problems(data: SFTDataConfig, trainer: TrainerConfig) -> list[str]:
    from controller.data.arithmetic import ARITHMETIC_OPERATORS
    from controller.data.chat_template import apply_chat_template_problem

    problems = []
    if data.task not in SFT_TASKS:
        return [f"data.task {data.task!r} is not one of {SFT_TASKS}"]
    if data.format not in SFT_FORMATS:
        problems.append(f"data.format {data.format!r} is not one of {SFT_FORMATS}")
    if data.batch_size < 1:
        problems.append(f"data.batch_size must be >= 1, got {data.batch_size}")
    if data.max_length < 2:
        problems.append(f"data.max_length must be >= 2 (a prompt token and a learned one), got {data.max_length}")
    if data.task in ("arithmetic", "calculator_transcripts"):
        if data.train_files or data.val_files:
            problems.append(f"data.train_files / val_files are set but data.task is {data.task!r}; set data.task=files")
        if data.train_size < data.batch_size or data.val_size < 0:
            problems.append(f"data.train_size ({data.train_size}) must be at least data.batch_size ({data.batch_size}) "
                            f"and data.val_size >= 0 (got {data.val_size})")
        if not data.operators or set(data.operators) - set(ARITHMETIC_OPERATORS):
            problems.append(f"data.operators {data.operators!r}: each must be one of {ARITHMETIC_OPERATORS!r}")
        if data.task == "calculator_transcripts":
            from controller.data.tool_transcripts import TOOL_CALL_TEMPLATES

            if data.tool_format not in TOOL_CALL_TEMPLATES:
                problems.append(f"data.tool_format {data.tool_format!r} is not one of {sorted(TOOL_CALL_TEMPLATES)}")
            if data.steps < 1:
                problems.append(f"data.steps must be >= 1, got {data.steps}")
    elif not data.train_files:
        problems.append("data.task 'files' needs data.train_files (one path or a list)")
    for path in (*data.train_files, *data.val_files):
        if not Path(path).exists():
            problems.append(f"data: example file {path} does not exist")
    has_val = data.val_files or (data.task != "files" and data.val_size > 0)
    if trainer.val_every and not has_val:
        problems.append(f"trainer.val_every {trainer.val_every} needs validation examples (data.val_files, or "
                        "data.val_size > 0 for the arithmetic task)")
    if problem := apply_chat_template_problem(data.apply_chat_template):
        problems.append(problem)
    return problems


def sft_config_to_dict(config: SFTConfig) -> dict[str, Any]:
    from controller.config import config_to_dict

    return {"kind": "sft", **config_to_dict(config)}
