"""The Ray backend: one Ray actor per rank, placed on placement-group bundles.

A pool of ``process_on_nodes=[n0, n1, ...]`` reserves one STRICT_PACK
placement group per entry (n_i bundles, so the ranks of one entry share a
node) and starts a WorkerHost actor in each bundle. Rank 0 names a free port
on its node; every actor then joins one torch.distributed world of the
pool's ranks. Pools are separate worlds, so split placement (actor on one
pool, critic on another) is two pools; colocation is several worker
groups on one pool, sharing its actors.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import Future

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from controller.errors import HostLostError
from controller.hosts import HostSet, map_failure
from workers.console import console_env, verbose_console
from workers.host import WorkerHost

__all__ = ["RayHostSet", "ensure_ray"]

class _RayWorkerHost(WorkerHost):
    def address(self) -> tuple[str, int, int]:
        """Rank 0's node as Ray knows it, so ranks on other nodes can reach the rendezvous."""
        _, port, pid = super().address()
        return ray.util.get_node_ip_address(), port, pid


_RemoteHost = ray.remote(_RayWorkerHost)


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to ``address`` (an existing cluster), or start a private local one.

    The local cluster binds to 127.0.0.1 with the dashboard off. Its CPU
    count is logical: it bounds how many single-CPU worker processes fit, so
    it defaults to at least 32 even on a two-core machine.
    """
    if ray.is_initialized():
        return
    # Worker processes import user modules (test files, scripts) by the
    # driver's path, as the driver itself does.
    # The console choice (workers.console) travels to the workers in their environment too.
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
           **{k: os.environ.get(k, v) for k, v in console_env(verbose_console()).items()}}
    runtime_env = {"env_vars": env}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return
    ray.init(
        num_cpus=num_cpus or max(32, os.cpu_count() or 1),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env=runtime_env,
        log_to_driver=True,
        configure_logging=False,
    )


class RayHostSet(HostSet):
    backend = "ray"

    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool,
        cpus_per_process: float,
        name: str,
        init_timeout_s: float,
        dist_timeout_s: float,
    ) -> None:
        super().__init__(sum(process_on_nodes))
        bundle = {"CPU": cpus_per_process, **({"GPU": 1} if use_gpu else {})}
        self.placement_groups = [
            placement_group([dict(bundle)] * n, strategy="STRICT_PACK", name=f"{name}-node{i}")
            for i, n in enumerate(process_on_nodes)
        ]
        try:
            ray.get([pg.ready() for pg in self.placement_groups], timeout=init_timeout_s)
        except GetTimeoutError:
            self._remove_placement_groups()
            raise RuntimeError(
                f"Ray could not reserve {process_on_nodes} bundles of {bundle} within {init_timeout_s:g} s; "
                f"the cluster has {ray.cluster_resources()}"
            ) from None
        self.actors = []
        for pg, count in zip(self.placement_groups, process_on_nodes):
            for local_rank in range(count):
                rank = len(self.actors)
                options = dict(
                    num_cpus=cpus_per_process,
                    num_gpus=1 if use_gpu else 0,
                    name=f"{name}-rank{rank}",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=local_rank),
                )
                self.actors.append(_RemoteHost.options(**options).remote(rank, self.world_size, local_rank))
        master_addr, master_port, _ = ray.get(self.actors[0].address.remote(), timeout=init_timeout_s)
        replies = ray.get(
            [a.init_distributed.remote(master_addr, master_port, dist_timeout_s) for a in self.actors],
            timeout=init_timeout_s,
        )
        for rank, reply in enumerate(replies):
            if not reply.ok:
                self.shutdown()
                raise RuntimeError(f"rank {rank} could not join torch.distributed:\n{reply.remote_traceback}")

    def _submit(self, rank: int, op: str, args: tuple) -> Future:
        def actor_died(error: BaseException) -> BaseException | None:
            if not isinstance(error, RayActorError):
                return None
            detail = f"its Ray actor died ({type(error).__name__})"
            self.mark_lost(rank, detail)
            return HostLostError(rank, detail)

        return map_failure(getattr(self.actors[rank], op).remote(*args).future(), actor_died)

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def shutdown(self) -> None:
        for actor in getattr(self, "actors", []):
            ray.kill(actor, no_restart=True)
        self.actors = []
        self._remove_placement_groups()

    def _remove_placement_groups(self) -> None:
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone with its cluster
                pass
        self.placement_groups = []
