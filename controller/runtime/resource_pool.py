"""ResourcePool: a set of worker processes that worker groups are placed on.

The same controller code runs on either backend:

    pool = ResourcePool([4])                      # 4 processes on one node
    actor = WorkerGroup(pool, Actor, role="actor")
    ref = WorkerGroup(pool, ReferencePolicy, role="ref")   # colocated with actor
    critic = WorkerGroup(ResourcePool([2]), Critic)        # split placement

``backend="auto"`` picks torchrun when the program was started by torchrun,
Ray otherwise. Under torchrun each pool takes the next free ranks of the
world, and the first pool created turns every rank but 0 into a server
(see ``controller.runtime.torchrun_backend``).
"""

from __future__ import annotations

import itertools
import os
import threading

from controller.runtime.hosts import HostSet

__all__ = ["ResourcePool"]

_BACKENDS = ("auto", "ray", "torchrun")
_pool_ids = itertools.count()


class ResourcePool:
    def __init__(
        self,
        process_on_nodes: int | list[int],
        *,
        backend: str = "auto",
        use_gpu: bool | None = None,
        cpus_per_process: float = 1,
        ray_address: str | None = None,
        name: str | None = None,
        init_timeout_s: float = 300.0,
        dist_timeout_s: float = 1800.0,
    ) -> None:
        nodes = [process_on_nodes] if isinstance(process_on_nodes, int) else list(process_on_nodes)
        if not nodes or any(not isinstance(n, int) or n < 1 for n in nodes):
            raise ValueError(f"process_on_nodes must be positive process counts per node, got {process_on_nodes!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; valid: {_BACKENDS}")
        self.process_on_nodes = nodes
        self.world_size = sum(nodes)
        self.name = name or f"pool{next(_pool_ids)}"
        self.roles: set[str] = set()
        self.process_group_key: str | None = None
        # Calls reach every rank in one order, so collectives inside worker
        # methods line up; groups sharing the pool's processes share the lock.
        self.submit_lock = threading.Lock()
        self.backend = self._resolve_backend(backend)
        if self.backend == "torchrun":
            self.hosts = self._torchrun_hosts(dist_timeout_s)
        else:
            self.hosts = self._ray_hosts(use_gpu, cpus_per_process, ray_address, init_timeout_s, dist_timeout_s)

    @staticmethod
    def _resolve_backend(backend: str) -> str:
        from controller.runtime.torchrun_backend import under_torchrun

        if backend == "auto":
            return "torchrun" if under_torchrun() else "ray"
        if backend == "torchrun" and not under_torchrun():
            raise RuntimeError("backend='torchrun' but this program was not started by torchrun")
        return backend

    def _torchrun_hosts(self, dist_timeout_s: float) -> HostSet:
        from controller.runtime.torchrun_backend import TorchrunHostSet, TorchrunRuntime

        runtime = TorchrunRuntime.get(dist_timeout_s=dist_timeout_s)
        if runtime.rank != 0:
            runtime.serve_forever()  # never returns: the process exits when rank 0 is done
        hosts = TorchrunHostSet(runtime, runtime.allocate(self.world_size))
        if hosts.global_ranks != list(range(runtime.world_size)):
            # A pool smaller than the world needs its own group; creating one is
            # collective over the whole world, members or not.
            self.process_group_key = self.name
            replies = [f.result() for f in hosts.submit_world("new_process_group", self.name, hosts.global_ranks)]
            failed = [(r, rep) for r, rep in enumerate(replies) if not rep.ok]
            if failed:
                rank, reply = failed[0]
                raise RuntimeError(f"rank {rank} could not build the process group of {self.name}:\n{reply.remote_traceback}")
        return hosts

    def _ray_hosts(self, use_gpu, cpus_per_process, ray_address, init_timeout_s, dist_timeout_s) -> HostSet:
        import ray

        from controller.runtime.ray_backend import RayHostSet, ensure_ray

        ensure_ray(ray_address)
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        return RayHostSet(self.process_on_nodes, use_gpu, cpus_per_process, self.name, init_timeout_s, dist_timeout_s)

    def claim_role(self, role: str) -> None:
        if role in self.roles:
            raise ValueError(f"role {role!r} is already placed on pool {self.name}; roles there: {sorted(self.roles)}")
        self.roles.add(role)

    def describe(self) -> str:
        """Where the pool's ranks run: "4 processes on 2 node(s): 127.0.0.12 (ranks [0, 1]), ..."."""
        nodes = list(dict.fromkeys(self.hosts.rank_nodes))
        if not nodes:
            return f"{self.world_size} processes"
        listing = ", ".join(f"{node} (ranks {self.hosts.ranks_on(node)})" for node in nodes)
        return f"{self.world_size} processes on {len(nodes)} node(s): {listing}"

    def controller_address(self) -> str:
        """The address this pool's workers reach the controller's process at (for a rendezvous it hosts)."""
        if self.backend == "ray":
            import ray

            return ray.util.get_node_ip_address()
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    def pids(self) -> list[int]:
        return self.hosts.pids()

    def shutdown(self) -> None:
        self.hosts.shutdown()

    def __enter__(self) -> "ResourcePool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"ResourcePool({self.name}, backend={self.backend}, process_on_nodes={self.process_on_nodes})"
