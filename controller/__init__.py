"""The single controller: resource pools and worker groups over Ray or torchrun."""

from controller.errors import CallTimeoutError, RemoteWorkerError, WorkerDiedError, WorkerGroupError
from controller.runtime.resource_pool import ResourcePool
from controller.runtime.worker_group import GroupFuture, WorkerGroup

__all__ = [
    "CallTimeoutError",
    "GroupFuture",
    "RemoteWorkerError",
    "ResourcePool",
    "WorkerDiedError",
    "WorkerGroup",
    "WorkerGroupError",
]
