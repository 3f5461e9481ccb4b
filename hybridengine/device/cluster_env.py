"""The environment variables that matter for collectives on a GPU cluster, with a default and a reason each.

A launch script exports them before it starts any process (tools/slurm/render.py writes them into the
sbatch scripts' environment block)::

    for line in cluster_env_lines({"NCCL_SOCKET_IFNAME": "ib0"}):
        print(line)

An entry whose default is None is left to NCCL and torch and shows commented out, its reason telling
when to set it; an override sets any entry, and a name the table does not know is exported as given.
The collective timeout itself is no variable: the worker hosts pass it to init_process_group.
"""

from __future__ import annotations

import re
import shlex
from typing import NamedTuple

__all__ = ["CLUSTER_ENV", "ClusterEnvVar", "cluster_env_lines"]


class ClusterEnvVar(NamedTuple):
    name: str
    default: str | None  # None: unset (NCCL's or torch's own choice)
    reason: str


CLUSTER_ENV = (
    # Which network the collectives use.
    ClusterEnvVar("NCCL_SOCKET_IFNAME", None,
                  "NCCL's interface, e.g. ib0 or ^docker,lo (unset: NCCL picks; a bad pick hangs)"),
    ClusterEnvVar("GLOO_SOCKET_IFNAME", None, "gloo's (torch.distributed's CPU groups): as NCCL_SOCKET_IFNAME"),
    # InfiniBand / RoCE.
    ClusterEnvVar("NCCL_IB_HCA", None, "the InfiniBand adapters to use, e.g. mlx5_0,mlx5_1 (unset: all found)"),
    ClusterEnvVar("NCCL_IB_GID_INDEX", None, "RoCE only: the adapters' RoCE v2 GID index, often 3"),
    ClusterEnvVar("NCCL_IB_DISABLE", None, "1: sockets only (no InfiniBand, or to rule it out of a hang)"),
    ClusterEnvVar("NCCL_DEBUG", "WARN", "INFO lists the interfaces and transports chosen: a new cluster's first check"),
    # Failures and hangs end the job instead of holding the allocation.
    ClusterEnvVar("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1",
                  "a failed or timed-out collective aborts and ends the process (torch: 3, no abort)"),
    ClusterEnvVar("TORCH_NCCL_BLOCKING_WAIT", None,
                  "1: wait() raises at the group's timeout, a traceback where it hangs"),
    ClusterEnvVar("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", None,
                  "seconds the watchdog may be stuck before an abort (torch: 480)"),
    ClusterEnvVar("TORCH_NCCL_TRACE_BUFFER_SIZE", None,
                  "e.g. 2000: the flight recorder keeps that many recent collectives"),
    ClusterEnvVar("TORCH_NCCL_DUMP_ON_TIMEOUT", None,
                  "1: dump the flight recorder on a timeout (needs a trace buffer)"),
    # megatron-core.
    ClusterEnvVar("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                  "megatron-core's TP communication overlap needs kernels in issue order"),
)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def cluster_env_lines(overrides: dict[str, str] | None = None) -> list[str]:
    """``export NAME=value  # reason`` per table entry (commented out where unset), then unknown overrides.

    Raises ValueError for an override whose name is no shell variable name.
    """
    overrides = dict(overrides or {})
    for name in overrides:
        if not _NAME.fullmatch(name):
            raise ValueError(f"environment variable name {name!r} is not a shell variable name "
                             "(letters, digits and _, not starting with a digit)")
    entries = []  # (the export, commented out where unset; its reason)
    for var in CLUSTER_ENV:
        value = overrides.pop(var.name, var.default)
        export = f"export {var.name}=" + ("" if value is None else shlex.quote(value))
        entries.append((export if value is not None else f"# {export}", var.reason))
    width = max(len(export) for export, _ in entries) + 2
    lines = [export.ljust(width) + f"# {reason}" for export, reason in entries]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in overrides.items()]
    return lines
