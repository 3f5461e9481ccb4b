"""Registered roles (``controller.rl.role_registry``): a role section the config holds must name one."""

from __future__ import annotations

from controller.checks.facts import JobFacts

__all__ = ["role_problems"]


def role_problems(job: JobFacts) -> list[str]:
    from controller.rl.role_registry import ROLE_TYPES

    return [f"roles.{name}: no role {name!r} is registered (controller.rl.role_registry.register_role); registered: "
            f"{sorted(ROLE_TYPES)}" for name in job.config.roles if name not in ROLE_TYPES]
