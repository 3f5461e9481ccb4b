"""Roles beside the built-in ones, each declared in one place: its config section, its worker, and the phase
of the step that calls it.

    @dataclass(frozen=True)
    class LengthBonusConfig:
        weight: float = 0.1

    register_role(RoleType(
        name="length_bonus",                       # its section (length_bonus: {weight: 0.5}) and placement key
        section=LengthBonusConfig,
        spec=lambda section, job: RoleSpec(LengthBonus, {"weight": section.weight}),
        phase="score",                             # after the reward, on each scored batch
        call=lambda group, batch, scores: add_bonus(scores, group.bonus(batch)),
    ))

A job whose config holds the role's section (``length_bonus:`` in YAML, or ``roles={"length_bonus": ...}``)
gets the role: declared with the others, placed like them (``trainer.placement.length_bonus``, or on the
default pool), built as a worker group of its own, and called by the step at its phase. Nothing else
changes: not the trainer, not the job's assembly, not the config tree.

``spec(section, job)`` declares the worker: ``job`` is the job's ``RoleContext``
(``controller.algorithms.algorithm_roles``: its config, the policy's and the actor's paths), read before any
process starts, so a spec may refuse what cannot run (a ConfigError naming the key).

Phases (``PHASES``):

- ``score``: ``call(group, batch, scores) -> scores``, after the reward and the algorithm's own roles
  (``RLAlgorithm.roles``: Safe-RLHF's cost) of every batch the step scores, generation rounds and validation
  included.
- ``log_probs``: ``call(group, batch) -> DataProto`` of the fields ``writes`` names, beside the old and reference
  log-probs and the values (on its own pool at the same time as theirs), joined into the batch before the
  advantages. A job with such a role computes the old log-probs before the update (they are what its fields are
  read against). The teacher of on-policy distillation is one (``controller.rl.teacher``).

A role that holds a megatron model gives ``engine(section, config)``, its engine as the job runs it: the planner
then sizes, places and times it (one forward pass over the step's sequences of ``section.model_path``), its
layout is checked and set like the built-in roles' (``teacher.engine.tensor_parallel=8``). ``check(section,
config)`` lists its problems before launch with every other check's.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.role_spec import RoleSpec

__all__ = ["PHASES", "ROLE_TYPES", "RoleType", "log_prob_roles", "reads_old_log_probs", "register_role", "role_engine",
           "role_phase"]

PHASES = ("score", "log_probs")


@dataclass(frozen=True)
class RoleType:
    """A role of the RL loop: its config section, how its worker is declared, and the phase that calls it."""

    name: str  # the role's name: its config section's key and its placement key
    section: type  # its config section, a dataclass whose fields are the section's keys
    spec: Callable[[Any, Any], RoleSpec]  # (its section, the job's RoleContext) -> the RoleSpec to build
    phase: str  # when the step calls it (PHASES)
    call: Callable[..., Any]  # the phase's call on its worker group (see PHASES)
    writes: tuple[str, ...] = ()  # log_probs: the batch fields its call gives
    # (its section, the job's RLConfig) -> its megatron EngineConfig as the job runs it; None: it holds no model
    engine: Callable[[Any, Any], Any] | None = None
    check: Callable[[Any, Any], list[str]] | None = None  # (its section, the job's RLConfig) -> problems

    def __post_init__(self) -> None:
        from controller.rl.role_assembly import ROLE_ORDER

        if not isinstance(self.name, str) or not self.name.isidentifier() or self.name in ROLE_ORDER:
            raise ValueError(f"a role's name must be an identifier and not a built-in role {ROLE_ORDER}, "
                             f"got {self.name!r}")
        if not dataclasses.is_dataclass(self.section):
            raise ValueError(f"role {self.name!r}: its section must be a dataclass, got {self.section!r}")
        if self.phase not in PHASES:
            raise ValueError(f"role {self.name!r}: phase {self.phase!r} is not one of {PHASES}")
        if not callable(self.spec) or not callable(self.call):
            raise ValueError(f"role {self.name!r}: spec and call must be functions")
        if (self.phase == "log_probs") != bool(self.writes):
            raise ValueError(f"role {self.name!r}: a role of the log_probs phase names the fields it writes "
                             f"(writes=...), and only such a role does; got phase {self.phase!r}, writes {self.writes!r}")
        for hook in ("engine", "check"):
            if getattr(self, hook) is not None and not callable(getattr(self, hook)):
                raise ValueError(f"role {self.name!r}: {hook} must be a function or None")


ROLE_TYPES: dict[str, RoleType] = {}


def register_role(role: RoleType, override: bool = False) -> RoleType:
    """Make ``role`` part of every job whose config holds its section."""
    if role.name in ROLE_TYPES and not override and ROLE_TYPES[role.name] != role:
        raise ValueError(f"role {role.name!r} is already registered; pass override=True to replace it")
    ROLE_TYPES[role.name] = role
    return role


def log_prob_roles(config) -> list[str]:
    """The registered roles of ``config`` (an RLConfig) that the step calls at the ``log_probs`` phase."""
    return [name for name in config.roles if name in ROLE_TYPES and ROLE_TYPES[name].phase == "log_probs"]


def reads_old_log_probs(config) -> bool:
    """Whether a step of ``config`` reads the old log-probs before the update (so the update's own forward cannot
    give them): a KL penalty in the reward, or a registered role's log-probs held against them (the teacher's)."""
    return config.algorithm.kl_in_reward or bool(log_prob_roles(config))


def role_engine(config, name: str):
    """Registered role ``name``'s megatron engine as ``config`` runs it; None where it holds no model."""
    role = ROLE_TYPES.get(name)
    if role is None or role.engine is None or name not in config.roles:
        return None
    return role.engine(config.roles[name], config)


def role_phase(name: str):
    """Registered role ``name``'s phase of the step as the phase flow declares one (a ``StepPhase``)."""
    from controller.rl.step_phases import StepPhase

    return StepPhase(name, reads=("responses",), writes=ROLE_TYPES[name].writes)


# The registered roles hybridflow ships: the teacher (on-policy distillation, and a KL term for any algorithm).
importlib.import_module("controller.rl.teacher")  # registers it
