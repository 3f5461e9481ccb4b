"""Names of the shared-memory segments vLLM's CPU backend opens for a TP group, unique to each engine.

vLLM's CPU communicator (``_CPUSHMDistributed``) names a TP group's segments
``{VLLM_DIST_IDENT}-{group}-[ranks]-cpushm_{i}`` under ``/dev/shm``. Its worker
derives ``VLLM_DIST_IDENT`` from the distributed init method: ``//`` under the
external launcher hybridflow uses, which ``shm_open`` drops. So every engine
on a machine would open the same names: two jobs at once would share (and
corrupt) one another's segments, and the segments of a job that did not run
vLLM's C++ static destructors (killed, or ended by ``exit_process``) would make
the next engine with the same ranks fail with ``create shm in SHMManager
failed. errno: 17``.

Each engine's ranks agree on a random token over their own generation TP
group; ``unique_segment_names`` prefixes the names with it while vLLM builds
its groups, and ``unlink_segments`` removes the names when the engine closes
(the ranks' mappings stay valid until they exit). Without vLLM's CPU
communicator (a build without it) both do nothing; the wrapper of vLLM's
naming is ``vllm_compat.shm_group_names``.
"""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

from workers.rollout.vllm_compat import shm_group_names

__all__ = ["agree_token", "unique_segment_names", "unlink_segments"]

SHM_DIR = Path("/dev/shm")


def agree_token(group: dist.ProcessGroup, group_ranks: list[int]) -> str:
    """A random token, the same on every rank of ``group`` (its first rank draws it)."""
    value = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    dist.broadcast(value, src=group_ranks[0], group=group)
    return f"hybridflow{int(value.item()):x}"


@contextlib.contextmanager
def unique_segment_names(token: str):
    """While vLLM builds its groups: every CPU shared-memory group name starts with ``token``."""

    def rename(name: str) -> str:
        # vLLM's own part starts with VLLM_DIST_IDENT, "//" under the external launcher: shm_open drops the
        # leading slashes of a name but refuses one inside it.
        return token + name.replace("/", "")

    with shm_group_names(rename):
        yield


def unlink_segments(token: str) -> list[str]:
    """Remove the names of every segment whose name starts with ``token``; returns the names removed."""
    if not SHM_DIR.is_dir():
        return []
    removed = []
    for path in SHM_DIR.glob(f"{token}*"):
        with contextlib.suppress(FileNotFoundError):  # another rank of the engine removed it first
            path.unlink()
            removed.append(path.name)
    return removed
