"""The rollout server: a user's agent found now, and a fixed port that is free."""

from __future__ import annotations

from controller.checks.facts import JobFacts

__all__ = ["agent_problems", "server_port_problems"]


def agent_problems(job: JobFacts) -> list[str]:
    """rollout.agent.entrypoint imported and its signature read now, not in a worker after start-up."""
    rollout = job.config.rollout
    if rollout.agent is None or rollout.agent.entrypoint is None:
        return []
    from controller.serving.user_agents import load_agent

    try:
        load_agent(rollout.agent.entrypoint)
    except ValueError as exc:
        return [str(exc)]
    return []


def server_port_problems(job: JobFacts) -> list[str]:
    return _server_port_problems(job.config.rollout)


def _server_port_problems(rollout) -> list[str]:
    """A rollout server whose fixed port is taken (the endpoint runs on the controller's node, where this runs)."""
    import socket

    if not rollout.server or not rollout.server_port:
        return []
    try:
        with socket.socket(socket.AF_INET6 if ":" in rollout.server_host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((rollout.server_host, rollout.server_port))
    except OSError as exc:
        reason = exc.strerror or exc
        return [f"rollout.server_port {rollout.server_port} on {rollout.server_host} cannot be bound ({reason}): "
                f"another process holds it; choose a free port, or 0 for any free one"]
    return []
