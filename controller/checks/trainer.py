"""The trainer section on its own: counts, restarts, export precision, the launcher and its addresses."""

from __future__ import annotations

from controller.checks.facts import JobFacts
from workers.megatron.config import PRECISIONS

__all__ = ["LAUNCHERS", "trainer_problems", "trainer_section_problems"]

LAUNCHERS = ("torchrun", "ray")


def trainer_section_problems(job: JobFacts) -> list[str]:
    return trainer_problems(job.config.trainer)


def trainer_problems(trainer) -> list[str]:
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


def _launch_problems(trainer) -> list[str]:
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


def _is_host_port(value: str) -> bool:
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
