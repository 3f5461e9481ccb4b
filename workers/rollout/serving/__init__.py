"""The rollout as a server: each replica's engine steps continuously over requests that arrive one by one
(``EngineLoop``), behind a token-in, token-out HTTP endpoint (``ReplicaServer``). The OpenAI-compatible
front end, its sessions and the trajectories built from them live with the controller
(``controller.serving``)."""

from workers.rollout.serving.engine_loop import EngineLoop, ServedTokens
from workers.rollout.serving.replica_server import ReplicaServer

__all__ = ["EngineLoop", "ReplicaServer", "ServedTokens"]
