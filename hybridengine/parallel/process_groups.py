"""torch.distributed subgroups that only their members create, one per rank set and process.

``dist.new_group`` is collective over the whole world: every process must
call it, member or not, in one order. A training grid on one pool, a second
grid on the same processes and a generation layout each want their own
groups, built by code that only their members run. ``subgroup`` creates a
group with local synchronization (only the members call it, in any order
relative to other groups) and keeps it, so a second request for the same
ranks, from another role in the same process, gets the same group: torch
names such groups after their ranks, so one rank set may exist only once.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

__all__ = ["group_ranks", "subgroup"]

# (the default group's identity, ranks) -> group: a new world (after destroy/init) starts afresh.
_GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}


def subgroup(ranks: Sequence[int]) -> Any:
    """The process group of ``ranks`` (global ranks); only its members call this, and this process is one."""
    key = tuple(sorted(int(r) for r in ranks))
    if len(set(key)) != len(key):
        raise ValueError(f"process group ranks {list(ranks)} repeat a rank")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank not in key:
        raise ValueError(f"rank {rank} asked for the process group of ranks {list(key)}, which it is not in")
    if key[0] < 0 or key[-1] >= world:
        raise ValueError(f"process group ranks {list(key)} are not all in the world of {world} ranks")
    if key == tuple(range(world)):
        return dist.group.WORLD
    world_id = id(dist.group.WORLD)
    for stale in [k for k in _GROUPS if k[0] != world_id]:
        del _GROUPS[stale]
    if (world_id, key) not in _GROUPS:
        _GROUPS[(world_id, key)] = dist.new_group(list(key), use_local_synchronization=True)
    return _GROUPS[(world_id, key)]


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None or WORLD: every rank), in increasing order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return sorted(dist.get_process_group_ranks(group))
