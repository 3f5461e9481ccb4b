"""The Ray backend: one Ray actor per rank, placed on placement-group bundles.

A pool of ``process_on_nodes=[n0, n1, ...]`` asks for one node per entry:
one placement group whose bundle i holds the CPUs (and GPUs) of n_i
processes, STRICT_SPREAD over the entries (so they land on different nodes)
or STRICT_PACK for a single entry. A WorkerHost actor starts in each
process's share of its bundle. Rank 0 names a free port on its node;
every actor then joins one torch.distributed world of the pool's ranks.
Pools are separate worlds, so split placement (actor on one pool, critic
on another) is two pools; colocation is several worker groups on one pool,
sharing its actors.

The call path is built for large batches:
- each DataProto chunk (and any other large argument) goes into the object
  store once, by ``ray.put``; a chunk several ranks receive (ONE_TO_ALL,
  the TP ranks of MESH_COMPUTE_PROTO) is one object passed to all of them
  by reference, unless the method was registered ``writes_inputs=True``;
- the references travel as top-level arguments, so Ray fetches them before
  the method runs and the worker sees zero-copy views of the object store;
- the results of all ranks come back through one ``ray.get`` over their
  references on the calling thread (it raises as soon as one rank's actor
  dies, so a peer stuck in a collective never holds the caller up).

Without an address, ``ensure_ray`` always starts a private local cluster on
a loopback address, whatever else runs on the machine or was left behind;
with one it joins that cluster and says so.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from controller.errors import HostLostError
from controller.runtime.hosts import CallOutcome, HostSet, RankCalls, map_failure
from controller.runtime.placement import ClusterNode, PlacementError, describe_cluster, fit_pools
from controller.runtime.ray_compat import actor_id_hex
from workers.console import console_env, verbose_console
from workers.data_proto import DataProto
from workers.host import Reply, WorkerHost

__all__ = ["RayHostSet", "ensure_ray", "PRIVATE_CLUSTER_IP", "cluster_for", "cluster_nodes", "healthy_nodes"]

# Ray turns 127.0.0.1 into the machine's interface address ("remotely
# reachable"); any other loopback address it keeps, so the private cluster's
# traffic never leaves the loopback interface.
PRIVATE_CLUSTER_IP = "127.0.0.2"
# Arguments below this size travel inside the call itself (Ray's own inline limit).
_PUT_THRESHOLD_BYTES = 100 * 1024


class _RayWorkerHost(WorkerHost):
    def address(self) -> tuple[str, int, int]:
        """Rank 0's node as Ray knows it, so ranks on other nodes can reach the rendezvous."""
        _, port, pid = super().address()
        return ray.util.get_node_ip_address(), port, pid

    def node(self) -> tuple[str, str]:
        """(node address, Ray node id) of this process."""
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def call(self, key: str, *values) -> tuple:
        """``execute`` of ``key`` = "role/method" with positional arguments as top-level values.

        Top-level values let Ray resolve their object refs before the call; a
        key string (none at all when it repeats the previous call's, see
        ``call_again``) and a plain tuple back, not a Reply dataclass, keep the
        round trip close to a bare Ray call: each argument costs Ray a serialisation.
        """
        self.last_key = key
        role, method = key.rsplit("/", 1)
        return _as_tuple(self.execute(role, method, values, {}))

    def call_again(self, *values) -> tuple:
        """``call`` of the previous call's key (calls run in the order they were sent): no key to send."""
        return self.call(self.last_key, *values)

    def call_kw(self, key: str, kw_names: tuple, *values) -> tuple:
        """``call`` with keyword arguments: the last ``len(kw_names)`` values are theirs."""
        role, method = key.rsplit("/", 1)
        n_args = len(values) - len(kw_names)
        return _as_tuple(self.execute(role, method, values[:n_args], dict(zip(kw_names, values[n_args:]))))


def _as_tuple(reply: Reply) -> tuple:
    return reply.ok, reply.value, reply.error_type, reply.remote_traceback, reply.layout


_RemoteHost = ray.remote(_RayWorkerHost)


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the cluster at ``address`` ("auto" or "host:port"), or start a private local one.

    With no address the cluster is always a new private one, bound to
    ``PRIVATE_CLUSTER_IP`` with the dashboard off, even when ``RAY_ADDRESS``
    is set or another cluster (or the address file of a stopped one) is on
    the machine. Its CPU count is logical: it bounds how many single-CPU
    worker processes fit, so it defaults to at least 32 even on a two-core
    machine. Joining, the driver registers as ``HYBRIDFLOW_NODE_IP`` when
    that is set (the address other nodes reach this one on).
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
        node_ip = os.environ.get("HYBRIDFLOW_NODE_IP")
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True, configure_logging=False,
                 **({"_node_ip_address": node_ip} if node_ip else {}))
        nodes = cluster_nodes()
        listing = ", ".join(f"{n['address']} ({n['CPU']:g} CPU, {n['GPU']:g} GPU)" for n in nodes)
        joined = ray.get_runtime_context().gcs_address  # what "auto" resolved to
        print(f"[hybridflow] joined the Ray cluster at {joined}: {len(nodes)} node(s): {listing}", file=sys.stderr)
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a private cluster reports nothing anywhere
    ray.init(
        address="local",
        num_cpus=num_cpus or private_cluster_cpus(),
        include_dashboard=False,
        _node_ip_address=PRIVATE_CLUSTER_IP,
        runtime_env=runtime_env,
        log_to_driver=True,
        configure_logging=False,
    )


def private_cluster_cpus() -> int:
    return max(32, os.cpu_count() or 1)


def cluster_for(address: str | None) -> list[ClusterNode]:
    """The nodes a job with ``trainer.ray_address = address`` gets, for the placement check before it starts.

    An address is joined now (the driver only; no worker starts); without one
    the answer is the private local cluster that ``ensure_ray`` would start.
    """
    if address is None:
        from hybridengine.device import accelerator_count

        return [ClusterNode(PRIVATE_CLUSTER_IP, float(private_cluster_cpus()), float(accelerator_count()))]
    ensure_ray(address)
    return [ClusterNode(n["address"], n["CPU"], n["GPU"]) for n in cluster_nodes()]


def cluster_nodes() -> list[dict]:
    """The connected cluster's live nodes: address, Ray node id and CPU / GPU counts."""
    return [
        {"address": n["NodeManagerAddress"], "node_id": n["NodeID"],
         "CPU": n["Resources"].get("CPU", 0.0), "GPU": n["Resources"].get("GPU", 0.0)}
        for n in sorted(ray.nodes(), key=lambda n: n["NodeManagerAddress"]) if n.get("Alive")
    ]


def healthy_nodes(grace_s: float = 60.0, probe_s: float = 10.0) -> list[dict]:
    """The live nodes that run a task now (``cluster_nodes`` entries): after a failure, a node that died is
    left out whether or not the GCS has marked it dead yet.

    Each node gets a task pinned to it; one that does not answer within
    ``probe_s`` is asked again (while the GCS's health checks catch up) until
    every listed node answers or ``grace_s`` is spent, when the silent ones are
    left out.
    """
    @ray.remote(num_cpus=0)
    def answer() -> bool:  # (nested: pickled by value, so a worker imports nothing of ours to run it)
        return True

    deadline = time.monotonic() + grace_s
    while True:
        nodes = cluster_nodes()
        probes = [answer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["node_id"], soft=False))
                  .remote() for n in nodes]
        ready, late = ray.wait(probes, num_returns=len(probes), timeout=probe_s)
        answered = []
        for node, probe in zip(nodes, probes):
            if probe in ready:
                try:
                    ray.get(probe)
                except Exception:  # noqa: BLE001 - its node went away under the probe
                    continue
                answered.append(node)
        for probe in late:
            try:
                ray.cancel(probe)
            except Exception:  # noqa: BLE001 - already failed with its node
                pass
        if len(answered) == len(nodes) or time.monotonic() >= deadline:
            return answered
        time.sleep(0.5)


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
        gpus = 1 if use_gpu else 0
        per_process = {"CPU": cpus_per_process, **({"GPU": gpus} if gpus else {})}
        bundles = [{k: v * n for k, v in per_process.items()} for n in process_on_nodes]
        strategy = "STRICT_SPREAD" if len(process_on_nodes) > 1 else "STRICT_PACK"
        what = (f"{process_on_nodes} bundles of {per_process} (one node per entry: {strategy} placement of "
                f"{bundles})")
        self.placement_groups = []
        nodes = [ClusterNode(n["address"], n["CPU"], n["GPU"]) for n in cluster_nodes()]
        try:  # a pool the whole cluster could never hold fails now, not after init_timeout_s
            fit_pools([(name, process_on_nodes)], nodes, cpus_per_process, use_gpu)
        except PlacementError:
            raise RuntimeError(f"Ray could not reserve {what}: the cluster has {describe_cluster(nodes)}") from None
        self.placement_groups = [placement_group(bundles, strategy=strategy, name=f"{name}-nodes")]
        try:
            ray.get(self.placement_groups[0].ready(), timeout=init_timeout_s)
        except GetTimeoutError:
            self._remove_placement_groups()
            raise RuntimeError(f"Ray could not reserve {what} within {init_timeout_s:g} s; the cluster has "
                               f"{describe_cluster(nodes)}, free now: {_free_resources()}") from None
        self.actors = []
        for node_index, count in enumerate(process_on_nodes):
            for local_rank in range(count):
                rank = len(self.actors)
                options = dict(
                    num_cpus=cpus_per_process,
                    num_gpus=gpus,
                    name=f"{name}-rank{rank}",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_groups[0], placement_group_bundle_index=node_index),
                )
                self.actors.append(_RemoteHost.options(**options).remote(rank, self.world_size, local_rank))
        self.actor_ranks = {actor_id_hex(actor): rank for rank, actor in enumerate(self.actors)}
        self.last_keys: list[str | None] = [None] * self.world_size  # the key each actor's call_again repeats
        # Where each rank runs first (the actors answer as soon as they are up), then the rendezvous.
        self.rank_nodes = [address for address, _ in ray.get([a.node.remote() for a in self.actors],
                                                               timeout=init_timeout_s)]
        master_addr, master_port, _ = ray.get(self.actors[0].address.remote(), timeout=init_timeout_s)
        pending = [a.init_distributed.remote(master_addr, master_port, dist_timeout_s) for a in self.actors]
        try:
            replies = ray.get(pending, timeout=init_timeout_s)
        except GetTimeoutError:
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
            late = [rank for rank, ref in enumerate(pending) if ref not in set(ready)]
            self.shutdown()
            raise RuntimeError(f"ranks {late} did not join torch.distributed (rendezvous {master_addr}:{master_port}) "
                               f"within {init_timeout_s:g} s; {self.describe_ranks(late)}") from None
        for rank, reply in enumerate(replies):
            if not reply.ok:
                self.shutdown()
                raise RuntimeError(f"rank {rank} could not join torch.distributed:\n{reply.remote_traceback}")

    def _submit(self, rank: int, op: str, args: tuple) -> Future:
        def actor_died(error: BaseException) -> BaseException | None:
            return self._lost(rank, error) if isinstance(error, RayActorError) else None

        return map_failure(getattr(self.actors[rank], op).remote(*args).future(), actor_died)

    def submit_calls(self, op: str, calls: dict[int, tuple], private_inputs: bool = False) -> RankCalls:
        """One object-store entry per distinct large argument, one actor call per rank, one wait for them all.

        ``private_inputs``: every rank gets its own copy of its large arguments
        (for methods that write into their inputs), never one shared object.
        Callers hold the pool's submit lock (``ResourcePool.submit_lock``): the
        order calls reach each actor in is the order they run in, which is what
        ``call_again`` relies on.
        """
        lost = sorted(r for r in calls if r in self.lost)
        if lost:
            return _FailedCalls(tuple(calls), lost[0], HostLostError(lost[0], f"its process was lost earlier "
                                                                                f"({self.lost[lost[0]]})"))
        refs: dict[int, ray.ObjectRef] = {}
        put: dict[int, ray.ObjectRef] = {}  # id(argument) -> its object, within this call

        def by_reference(value):
            if not _large(value):
                return value
            if private_inputs:
                return ray.put(value)
            if id(value) not in put:
                put[id(value)] = ray.put(value)
            return put[id(value)]

        for rank, args in calls.items():
            actor = self.actors[rank]
            if op == "execute":
                role, method, call_args, call_kwargs = args
                values = [by_reference(v) for v in (*call_args, *call_kwargs.values())]
                key = f"{role}/{method}"
                if call_kwargs:
                    refs[rank] = actor.call_kw.remote(key, tuple(call_kwargs), *values)
                    self.last_keys[rank] = None  # call_kw does not set the key call_again repeats
                elif self.last_keys[rank] == key:
                    refs[rank] = actor.call_again.remote(*values)
                else:
                    refs[rank] = actor.call.remote(key, *values)
                    self.last_keys[rank] = key
            else:
                refs[rank] = getattr(actor, op).remote(*args)
        return _RayCalls(self, refs)

    def _lost(self, rank: int, error: BaseException) -> HostLostError:
        detail = f"its Ray actor died ({type(error).__name__}: {_first_line(error)})"
        self.mark_lost(rank, detail)
        return HostLostError(rank, detail)

    def rank_of_actor(self, actor_id: str | None) -> int | None:
        return self.actor_ranks.get(actor_id) if actor_id else None

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def shutdown(self) -> None:
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - its node is already gone
                pass
        self.actors = []
        self._remove_placement_groups()

    def _remove_placement_groups(self) -> None:
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone with its cluster
                pass
        self.placement_groups = []


class _RayCalls(RankCalls):
    """The object refs of one call's ranks, resolved by one ``ray.get`` on the caller's thread."""

    def __init__(self, hosts: RayHostSet, refs: dict[int, "ray.ObjectRef"]) -> None:
        self.hosts = hosts
        self.refs = refs
        self.ranks = tuple(sorted(refs))

    def done(self) -> bool:
        refs = list(self.refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return len(ready) == len(refs)

    def wait(self, timeout: float | None) -> CallOutcome:
        refs = list(self.refs.values())
        try:
            replies = ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            ready_set = set(ready)
            return CallOutcome({}, late=tuple(r for r, ref in sorted(self.refs.items()) if ref not in ready_set))
        except RayActorError as error:
            rank = self.hosts.rank_of_actor(getattr(error, "actor_id", None))
            if rank is None:  # find the rank whose reference holds the error
                rank = next((r for r, ref in sorted(self.refs.items()) if _raises(ref)), self.ranks[0])
            return CallOutcome({}, (rank, self.hosts._lost(rank, error)))
        return CallOutcome({rank: r if isinstance(r, Reply) else Reply(*r) for rank, r in zip(self.refs, replies)})


class _FailedCalls(RankCalls):
    def __init__(self, ranks: tuple[int, ...], rank: int, error: BaseException) -> None:
        self.ranks, self.failure = ranks, (rank, error)

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None) -> CallOutcome:
        return CallOutcome({}, self.failure)


def _large(value) -> bool:
    """Whether an argument goes into the object store rather than inside the call."""
    if isinstance(value, DataProto):
        return value.nbytes >= _PUT_THRESHOLD_BYTES
    nbytes = getattr(value, "nbytes", None)  # numpy arrays; tensors below
    if nbytes is None and hasattr(value, "element_size") and hasattr(value, "numel"):
        nbytes = value.element_size() * value.numel()
    return isinstance(nbytes, int) and nbytes >= _PUT_THRESHOLD_BYTES


def _raises(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0, fetch_local=False)
    if not ready:
        return False
    try:
        ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001 - this is the one that failed
        return True
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""


def _free_resources() -> dict[str, float]:
    return {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
