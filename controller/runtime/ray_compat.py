"""Every use of Ray's private names (the guard: ``hybridengine.compat``).

``RAY.patches`` says why each exists and when it can go. Ray is imported by
the caller; this module only reads what it is handed.
"""

from __future__ import annotations

from typing import Any

from hybridengine.compat import LibraryShim, Patch

__all__ = ["RAY", "actor_id_hex"]

RAY = LibraryShim(
    "ray",
    distributions=("ray",),
    written_for=("2.60",),
    module=__name__,
    patches=[
        Patch("actor_handle_id",
              why="a dead actor's RayActorError names it by actor id, and the handle gives its id only through "
                  "the private ActorHandle._actor_id; the backend maps those ids to ranks.",
              remove_when="Ray's ActorHandle exposes its actor id publicly."),
    ],
)
RAY.check_version()


@RAY.applies("actor_handle_id")
def actor_id_hex(actor: Any) -> str:
    """The hex actor id of the Ray actor handle ``actor`` (what ``RayActorError.actor_id`` reports)."""
    return RAY.require(actor, "_actor_id", patch="actor_handle_id").hex()
