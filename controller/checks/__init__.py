"""Each feature's cross-section checks, in a room of its own, run in one list before any process starts.

A check is a function of ``JobFacts`` (the config, the models' specs, the cluster, the pools, the problems
found so far) returning its problems, each one a line naming the key and what is valid.
``controller.config.check_config`` runs ``CHECKS`` in order and raises them all at once; a feature of
one's own adds its check with ``register_check``.
"""

from __future__ import annotations

from collections.abc import Callable

from controller.checks import (algorithm, data, layouts, lora, placement, reward, roles, router_replay, sandbox,
                               schedule, serving, trainer, vision)
from controller.checks.facts import JobFacts

__all__ = ["CHECKS", "JobFacts", "register_check", "run_checks"]

Check = Callable[[JobFacts], list[str]]

CHECKS: list[Check] = [
    algorithm.algorithm_problems,
    trainer.trainer_section_problems,
    schedule.schedule_problems,
    router_replay.router_replay_problems,
    serving.agent_problems,
    lora.lora_sync_problems,
    placement.placement_problems,
    data.data_section_problems,
    reward.reward_problems,
    sandbox.sandbox_problems,
    serving.server_port_problems,
    layouts.layout_problems,
    roles.role_problems,
    vision.vision_problems,
]


def register_check(check: Check) -> Check:
    """Run ``check`` with every job's checks, after the built-in ones (usable as a decorator)."""
    if not callable(check):
        raise TypeError(f"a check is a function of JobFacts, got {check!r}")
    CHECKS.append(check)
    return check


def run_checks(config, model_spec=None, cluster=None, reward_spec=None) -> list[str]:
    """Every problem of ``config``, each check's in order."""
    job = JobFacts(config, model_spec, reward_spec, cluster)
    for check in CHECKS:
        job.problems += check(job)
    return job.problems
