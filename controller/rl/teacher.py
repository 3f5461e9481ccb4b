"""The teacher role: a frozen model that scores every token the student samples (``teacher:`` in a job's config).

    teacher:
      model_path: runs/sft_tiny/hf_actor    # any HF causal LM whose tokenizer is the student's
      engine: {tensor_parallel: 2}          # its own layout; left out: the reference policy's (else the actor's)
    algorithm: {name: opd}                  # per-token advantages from the reverse KL (controller.algorithms.opd)
    # or, for any other algorithm, the teacher as the KL term in the actor's loss:
    algorithm: {name: grpo, teacher_kl_coef: 0.1}

A role of the role registry (``controller.rl.role_registry``) at the ``log_probs`` phase: its worker
(``workers.teacher.Teacher``) gives ``teacher_log_probs`` beside the old and reference log-probs and the values, on
its pool at the same time as theirs (``trainer.placement.teacher``; by default the job's default pool). The planner
sizes, places and times it like the reference policy. It is frozen: no optimizer, no checkpoint of its own (a
restarted job loads it again from ``model_path``), no part in the 3D-HybridEngine.

Its log-probs come from megatron's forward at its own layout, not from vLLM's prompt log-probs: the same fused
output-layer kernel and dispatch as the student's own log-probs (a teacher equal to the student gives a reverse
KL of exactly 0), the teacher's TP / PP / CP chosen for memory like any forward-only role, and one batched pass
over token ids the student already holds, where a vLLM prompt-log-prob request returns a Python mapping per
position and needs a second inference engine's memory on the pool.

Refused before launch, naming the setting: a teacher whose tokenizer is not the student's (both tokenizers and
the first token they differ at), a teacher no algorithm reads, an ``opd`` job or a ``teacher_kl_coef`` without
one, and ``trainer.mode: async``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from controller.errors import ConfigError
from controller.rl.role_registry import RoleType, register_role
from workers.data_proto import DataProto
from workers.megatron.config import EngineConfig
from workers.role_spec import RoleSpec
from workers.teacher import TEACHER_LOG_PROBS, Teacher

__all__ = ["TeacherConfig", "teacher_engine", "teacher_problems", "tokenizer_mismatch"]


@dataclass(frozen=True)
class TeacherConfig:
    """The teacher: its checkpoint and its engine's layout."""

    # an HF causal LM (a directory or a hub id) whose tokenizer is the student's (the actor's)
    model_path: str | None = None
    # its megatron engine (TP / PP / CP, precision, micro-batches); None: the reference policy's (ref_policy.engine,
    # else the actor's). One given is whole: the fields it leaves out take EngineConfig's defaults
    engine: EngineConfig | None = None
    device_map: str | None = None  # "auto": the planner's fastest TP x PP that fits the job's devices
    # "package.module:Class" or a class: a subclass of workers.teacher.Teacher to run
    worker: str | type | None = None

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required: the teacher's HF checkpoint (a directory or a hub id)")
        if str(self.model_path).startswith("builtin:"):
            raise ValueError(f"model_path {self.model_path!r}: a built-in model is random, nothing to learn from; "
                             f"give a trained HF checkpoint (a directory or a hub id)")
        if self.device_map not in (None, "auto"):
            raise ValueError(f"device_map {self.device_map!r} is not supported; valid: 'auto' or null")


def teacher_engine(section: TeacherConfig, config) -> EngineConfig:
    """The teacher's engine as ``config`` runs it: its own, else the reference policy's, else the actor's."""
    if section.engine is not None:
        return section.engine
    return (config.ref_policy or config.actor).engine


def _teacher_spec(section: TeacherConfig, job) -> RoleSpec:
    from controller.rl.role_specs import worker_class
    from workers.pretrained import resolve_pretrained

    problem = tokenizer_mismatch(job.actor_path, section.model_path)
    if problem is not None:
        raise ConfigError(problem)
    engine = teacher_engine(section, job.config)
    return RoleSpec(worker_class(section.worker, Teacher, "teacher.worker"),
                    {"model_path": resolve_pretrained(section.model_path, missing_ok=True), "engine": engine},
                    device_map=section.device_map,
                    explicit_parallelism=(engine.tensor_parallel, engine.pipeline_parallel) != (1, 1))


def _teacher_log_probs(group, batch: DataProto) -> DataProto:
    return group.compute_teacher_log_prob(batch)


def teacher_problems(section: TeacherConfig, config) -> list[str]:
    """What keeps a job with a teacher from running, before launch."""
    from controller.algorithms.algorithm import resolve_algorithm

    alg = config.algorithm
    problems = []
    try:
        distils = resolve_algorithm(alg.name)[0].reads_teacher
    except ValueError:  # an unknown algorithm: its own check says so
        distils = True
    if not distils and not alg.teacher_kl_coef:
        problems.append("teacher: is set, but nothing reads it: use algorithm.name=opd (on-policy distillation) or "
                        "algorithm.teacher_kl_coef > 0 (the teacher as the KL term of another algorithm)")
    if config.trainer.mode == "async":
        problems.append("teacher: trainer.mode=async is refused: its responses are sampled across weight updates "
                        "(partial rollouts, samples up to trainer.max_staleness updates old), so the teacher's "
                        "log-probs would be held against a student that did not sample them; use sync or "
                        "one_step_off")
    problems += _model_problems(section, config)
    student = _student_path(config)
    if student is not None:
        problem = tokenizer_mismatch(student, section.model_path)
        if problem is not None:
            problems.append(problem)
    return problems


def _model_problems(section: TeacherConfig, config) -> list[str]:
    """The teacher's checkpoint as megatron holds it, split as its engine asks (heads over TP, layers over PP)."""
    from controller.checks.layouts import model_split_problem, sequence_layout_problem
    from hybridengine.model.spec import ModelConfigError, ModelSpec
    from workers.pretrained import resolve_pretrained

    path = resolve_pretrained(section.model_path, missing_ok=True)
    if not Path(path, "config.json").is_file():
        return [f"teacher.model_path {section.model_path!r}: no HF checkpoint there (no config.json)"]
    try:
        spec = ModelSpec.from_pretrained(path)
    except ModelConfigError as exc:
        return [f"teacher.model_path: {exc}"]
    engine = teacher_engine(section, config)
    return [p for p in (model_split_problem("teacher.engine", spec, engine),
                        sequence_layout_problem("teacher.engine", spec, engine)) if p]


def _student_path(config) -> str | None:
    """The student's checkpoint directory, where it exists already (a built-in one under the run directory)."""
    path = config.actor.model_path or config.model_path
    if path.startswith("builtin:"):
        if config.trainer.run_dir is None:
            return None  # made by the job's assembly, which checks the tokenizers when it declares the teacher
        from controller.models.builtin import resolve_model_path

        return resolve_model_path(path, Path(config.trainer.run_dir))
    return path


@functools.lru_cache(maxsize=8)
def tokenizer_mismatch(student_path: str, teacher_path: str) -> str | None:
    """None where the teacher's tokenizer is the student's (the same token at every id, the same special
    tokens); else the problem, naming both tokenizers and the first token they differ at."""
    from transformers import AutoTokenizer

    from workers.pretrained import resolve_pretrained

    try:
        teacher = AutoTokenizer.from_pretrained(resolve_pretrained(teacher_path))
    except (OSError, ValueError) as exc:
        return f"teacher.model_path {teacher_path!r}: no tokenizer loads from it ({exc})"
    student = AutoTokenizer.from_pretrained(resolve_pretrained(student_path))

    def named(tokenizer, path: str) -> str:
        return f"{type(tokenizer).__name__} of {path}, {len(tokenizer)} tokens"

    def by_id(tokenizer) -> dict[int, str]:
        return {index: token for token, index in tokenizer.get_vocab().items()}

    ours, theirs = by_id(student), by_id(teacher)
    lead = (f"teacher.model_path: the teacher's tokenizer ({named(teacher, teacher_path)}) is not the student's "
            f"({named(student, student_path)})")
    why = "; the teacher reads the student's token ids as they are, so the two must share one tokenizer"
    for index in sorted(set(ours) | set(theirs)):
        if ours.get(index) != theirs.get(index):
            return (f"{lead}: they first differ at token id {index}: {ours.get(index)!r} in the student's, "
                    f"{theirs.get(index)!r} in the teacher's{why}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return (f"{lead}: their {name} differ ({getattr(student, name)!r} in the student's, "
                    f"{getattr(teacher, name)!r} in the teacher's){why}")
    return None


TEACHER = register_role(RoleType(
    name="teacher", section=TeacherConfig, spec=_teacher_spec, phase="log_probs", call=_teacher_log_probs,
    writes=(TEACHER_LOG_PROBS,), engine=teacher_engine, check=teacher_problems))
