"""Registered roles (``controller.rl.role_registry``): a role section the config holds names one, and passes its
own check."""

from __future__ import annotations

from controller.checks.facts import JobFacts

__all__ = ["role_problems"]


def role_problems(job: JobFacts) -> list[str]:
    """A role section names a registered role, and passes that role's own check (``RoleType.check``)."""
    from controller.rl.role_registry import ROLE_TYPES

    problems = []
    for name, section in job.config.roles.items():
        role = ROLE_TYPES.get(name)
        if role is None:
            problems.append(f"roles.{name}: no role {name!r} is registered (controller.rl.role_registry.register_role); "
                            f"registered: {sorted(ROLE_TYPES)}")
        elif role.check is not None and isinstance(section, role.section):
            problems += role.check(section, job.config)
    return problems
