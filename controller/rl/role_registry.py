"""Roles beside the built-in ones, each declared in one place: its config section, its worker, and the phase
of the step that calls it.

    @dataclass(frozen=True)
    class LengthBonusConfig:
        weight: float = 0.1

    register_role(RoleType(
        name="length_bonus",                       # its section (length_bonus: {weight: 0.5}) and placement key
        section=LengthBonusConfig,
        spec=lambda section, policy_path: RoleSpec(LengthBonus, {"weight": section.weight}),
        phase="score",                             # after the reward, on each scored batch
        call=lambda group, batch, scores: add_bonus(scores, group.bonus(batch)),
    ))

A job whose config holds the role's section (``length_bonus:`` in YAML, or ``roles={"length_bonus": ...}``)
gets the role: declared with the others, placed like them (``trainer.placement.length_bonus``, or on the
default pool), built as a worker group of its own, and called by the step at its phase. Nothing else
changes: not the trainer, not the job's assembly, not the config tree.

Phases (``PHASES``): ``score``, ``call(group, batch, scores) -> scores``, after the reward and the algorithm's own
roles (``RLAlgorithm.roles``: Safe-RLHF's cost) of every batch the step scores, generation rounds and validation
included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.role_spec import RoleSpec

__all__ = ["PHASES", "ROLE_TYPES", "RoleType", "register_role"]

PHASES = ("score",)


@dataclass(frozen=True)
class RoleType:
    """A role of the RL loop: its config section, how its worker is declared, and the phase that calls it."""

    name: str  # the role's name: its config section's key and its placement key
    section: type  # its config section, a dataclass whose fields are the section's keys
    spec: Callable[[Any, str], RoleSpec]  # (its section, the policy's path) -> the RoleSpec to build
    phase: str  # when the step calls it (PHASES)
    call: Callable[..., Any]  # the phase's call on its worker group (see PHASES)

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


ROLE_TYPES: dict[str, RoleType] = {}


def register_role(role: RoleType, override: bool = False) -> RoleType:
    """Make ``role`` part of every job whose config holds its section."""
    if role.name in ROLE_TYPES and not override and ROLE_TYPES[role.name] != role:
        raise ValueError(f"role {role.name!r} is already registered; pass override=True to replace it")
    ROLE_TYPES[role.name] = role
    return role

