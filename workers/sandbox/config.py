"""SandboxConfig: a job's ``sandbox`` section, and the check that refuses a job whose sandbox cannot isolate.

::

    sandbox:
      isolation: auto          # bwrap, else unshare; neither: the job is refused before launch
      # isolation: limits-only # resource limits alone (no network, file or process isolation), said explicitly

The job's level becomes the process default (``set_default_isolation``) of
its reward and rollout workers, so the built-in rewards, the ``python`` tool
and a user's own reward calling ``hybridflow.sandbox.run`` all run at it.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.sandbox.isolation import AUTO, LEVELS, resolve_level

__all__ = ["SANDBOX_REWARDS", "SANDBOX_TOOLS", "SandboxConfig", "isolation_problem"]

SANDBOX_REWARDS = ("code_exec", "code_expression", "code_expression_shaped")  # built-in rewards that run code
SANDBOX_TOOLS = ("python",)  # built-in agent tools that run code


@dataclass(frozen=True)
class SandboxConfig:
    """Where model-written code runs: the isolation level (``workers.sandbox.isolation``)."""

    isolation: str = AUTO  # auto (bwrap, else unshare), bwrap, unshare, or limits-only (said explicitly)

    def __post_init__(self) -> None:
        if self.isolation != AUTO and self.isolation not in LEVELS:
            raise ValueError(f"sandbox.isolation {self.isolation!r} is not one of {[AUTO, *LEVELS]}")


def isolation_problem(isolation: str) -> str | None:
    """None when ``isolation`` runs on this machine, else why not and what to do (one line). "auto" is what
    the workers will resolve: ``$HYBRIDFLOW_SANDBOX`` where set, else bwrap or unshare."""
    try:
        resolve_level(None if isolation == AUTO else isolation)
    except (RuntimeError, ValueError) as exc:
        return str(exc).replace("isolation=", "sandbox.isolation=", 1) if isolation != AUTO else str(exc)
    return None
