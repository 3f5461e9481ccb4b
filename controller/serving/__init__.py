"""The rollout behind an OpenAI-compatible endpoint (``rollout.server``), and users' agents as environments.

- ``server.RolloutServer``: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on loopback,
  streaming included, served by the rollout replicas' engines (``workers.rollout.serving``) through
  ``router.ReplicaRouter``, which keeps a session on one replica;
- ``session.Session``: what a session was served, as ids, and the next prompt built by appending to them;
- ``trajectories.session_samples``: a session's training samples, split where a request did not extend the
  ones before it;
- ``user_agents``: ``async def agent(client, row)`` run for every sample, many at once.
"""

from controller.serving.router import ReplicaRouter
from controller.serving.server import RolloutServer
from controller.serving.session import ServedTurn, Session
from controller.serving.trajectories import ServedSample, session_samples

__all__ = ["ReplicaRouter", "RolloutServer", "ServedSample", "ServedTurn", "Session", "session_samples"]
