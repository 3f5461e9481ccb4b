"""One controller program, run by the Ray tests in-process and by the torchrun tests
as ``torchrun --nproc-per-node 4 group_scenarios.py <scenario> <out.json>``.

The same worker classes and the same controller code on both backends; each
scenario returns plain data that the tests check against values computed here
from the inputs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from controller import CallTimeoutError, RemoteWorkerError, ResourcePool, WorkerDiedError, WorkerGroup
from controller.runtime.process_exit import exit_process
from hybridengine.parallel.layout import ParallelLayout
from workers import BaseWorker, DataProto, Dispatch, DispatchError, RankCall, register, register_dispatch_mode


def _first_half(view, args, kwargs):
    half = view.world_size // 2
    return [RankCall(args, kwargs) if r < half else None for r in range(view.world_size)], half


def _by_rank(view, outputs, half):
    return {"half": half, "outputs": {str(r): v for r, v in sorted(outputs.items())}}


register_dispatch_mode("first_half", _first_half, _by_rank)


class ScenarioWorker(BaseWorker):
    def __init__(self, tensor_parallel: int = 1, pipeline_parallel: int = 1, secret: float = 0.0) -> None:
        self.set_layout(ParallelLayout.for_world(self.world_size, tensor_parallel, pipeline_parallel))
        self.executed = 0
        self.secret = secret
        self.last_chunk: list[int] = []

    @register(Dispatch.ONE_TO_ALL)
    def executed_calls(self) -> int:
        return self.executed

    @register(Dispatch.ONE_TO_ALL)
    def echo(self, value, tag="t"):
        self.executed += 1
        return [self.rank, value, tag]

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, value):
        self.executed += 1
        return value * (self.rank + 1)

    @register(Dispatch.RANK_ZERO)
    def only_rank_zero(self):
        self.executed += 1
        return self.rank

    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        self.executed += 1
        return DataProto({"y": data.batch["x"] * 2, "rank": torch.full((len(data),), self.rank)})

    @register(Dispatch.MESH_COMPUTE_PROTO)
    def mesh_sum(self, data: DataProto) -> DataProto:
        """Sums x over the ranks of the worker's TP group, so the result needs a real collective."""
        self.executed += 1
        self.last_chunk = data.batch["x"].tolist()
        tp = self.layout.tp
        total = data.batch["x"].clone()
        # The TP group of this rank, built from the layout on the group's own process group.
        tp_group_ranks = [g for g in self.layout.tp_groups() if self.rank in g][0]
        gathered = [torch.zeros_like(total) for _ in range(self.world_size)]
        dist.all_gather(gathered, total, group=self.process_group)
        total = sum(gathered[r] for r in tp_group_ranks)
        assert len(tp_group_ranks) == tp
        return DataProto({"tp_sum": total, "rank": torch.full((len(data),), self.rank)})

    @register(Dispatch.ONE_TO_ALL)
    def chunks_seen(self):
        return self.last_chunk

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        tensor = torch.tensor([value + self.rank], dtype=torch.float64)
        dist.all_reduce(tensor, group=self.process_group)
        return tensor.item()

    @register("first_half")
    def custom(self):
        self.executed += 1
        return self.rank * 10

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def sleep(self, seconds: float) -> float:
        start = time.time()
        time.sleep(seconds)
        return start

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int):
        if self.rank == rank:
            raise ValueError(f"bad sample on purpose at rank {rank}")
        return "fine"

    @register(Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        """This rank's node as the launcher sees it, and a world all-reduce to show the ranks form one world."""
        node = {"pid": os.getpid(), "rank": self.rank, "node_rank": os.environ.get("GROUP_RANK")}
        if os.environ.get("RAY_RAYLET_PID") or "ray" in sys.modules:
            import ray

            if ray.is_initialized():
                node.update(ray_node_id=ray.get_runtime_context().get_node_id(),
                            node_ip=ray.util.get_node_ip_address())
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total, group=self.process_group)
        node["world_sum"] = total.item()
        import psutil  # every address this process talks to (gloo's peers, the store, the controller)

        node["remote_hosts"] = sorted({c.raddr.ip.removeprefix("::ffff:")
                                       for c in psutil.Process().net_connections(kind="tcp") if c.raddr})
        return node

    @register(Dispatch.ONE_TO_ALL)
    def input_memory(self, data: DataProto) -> str:
        """The mapping of this process that holds ``data``'s tensor (/proc/self/maps): shared memory or private."""
        address = data.batch["x"].data_ptr()
        with open("/proc/self/maps") as maps:
            for line in maps:
                low, high = (int(v, 16) for v in line.split()[0].split("-"))
                if low <= address < high:
                    fields = line.split()
                    return fields[5] if len(fields) > 5 else "anonymous"
        return "unmapped"

    @register(Dispatch.ONE_TO_ALL, writes_inputs=True)
    def add_rank_in_place(self, data: DataProto) -> list:
        data.batch["x"] += self.rank + 1  # in place: it asked for its own copy
        return data.batch["x"][:3].tolist()

    @register(Dispatch.ONE_TO_ALL)
    def read_peer_secret(self, role: str):
        """Reads another role's object in the same process: colocated roles share memory."""
        peer = self.peer(role)
        return [peer.secret, os.getpid(), peer.role]


def modes(backend: str) -> dict:
    pool = ResourcePool([4], backend=backend)
    tp = WorkerGroup(pool, ScenarioWorker, kwargs={"tensor_parallel": 2}, role="tp2")
    pp = WorkerGroup(pool, ScenarioWorker, kwargs={"pipeline_parallel": 2}, role="pp2")
    out = {
        "layouts": [str(tp.layout), str(pp.layout)],
        "echo": tp.echo(5, tag="x"),
        "scale": tp.scale([1, 2, 3, 4]),
        "rank_zero": tp.only_rank_zero(),
        "custom": tp.custom(),
        "all_reduce": tp.all_reduce(0.5),
    }
    data = DataProto({"x": torch.arange(7)})
    doubled = tp.double(data)
    out["double"] = {"y": doubled.batch["y"].tolist(), "rank": doubled.batch["rank"].tolist()}
    for name, group in (("mesh_tp", tp), ("mesh_pp", pp)):
        result = group.mesh_sum(DataProto({"x": torch.arange(6)}))
        out[name] = {"tp_sum": result.batch["tp_sum"].tolist(), "rank": result.batch["rank"].tolist()}
        out[name + "_chunks"] = group.chunks_seen()
    out["executed_before_bad_input"] = tp.executed_calls()
    errors = {}
    for label, call in (
        ("all_to_all_length", lambda: tp.scale([1, 2])),
        ("dp_non_proto", lambda: tp.double([1, 2, 3])),
        ("unregistered", lambda: tp.not_a_method()),
        ("private", lambda: tp.chunks_seen_typo),
    ):
        try:
            call()
            errors[label] = "no error"
        except (DispatchError, AttributeError) as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
    out["errors"] = errors
    out["executed_after_bad_input"] = tp.executed_calls()
    pool.shutdown()
    return out


def colocated_and_split(backend: str) -> dict:
    shared = ResourcePool([2], backend=backend)
    actor = WorkerGroup(shared, ScenarioWorker, kwargs={"secret": 3.5}, role="actor")
    ref = WorkerGroup(shared, ScenarioWorker, kwargs={"secret": -1.0}, role="ref")
    other = ResourcePool([2], backend=backend)
    critic = WorkerGroup(other, ScenarioWorker, role="critic")
    out = {
        "actor_pids": [info["pid"] for info in actor.worker_info()],
        "ref_pids": [info["pid"] for info in ref.worker_info()],
        "critic_pids": [info["pid"] for info in critic.worker_info()],
        "ref_reads_actor": ref.read_peer_secret("actor"),
        "critic_all_reduce": critic.all_reduce(0.0),
        "actor_all_reduce": actor.all_reduce(0.0),
    }
    try:
        WorkerGroup(shared, ScenarioWorker, role="actor")
        out["duplicate_role"] = "no error"
    except ValueError as exc:
        out["duplicate_role"] = str(exc)
    # Two groups on separate pools work at once: both sleeps overlap.
    started = time.time()
    futures = [actor.sleep(1.5), critic.sleep(1.5)]
    starts = [min(f.result()) for f in futures]
    out["overlap_wall_s"] = time.time() - started
    out["start_gap_s"] = abs(starts[0] - starts[1])
    shared.shutdown()
    other.shutdown()
    return out


def faults(backend: str) -> dict:
    pool = ResourcePool([3], backend=backend)
    group = WorkerGroup(pool, ScenarioWorker, role="faulty", call_timeout_s=None)
    out = {}
    try:
        group.fail_on(1)
    except RemoteWorkerError as exc:
        out["raised"] = {"rank": exc.rank, "method": exc.method, "type": exc.error_type, "text": str(exc)}
    out["after_error"] = group.echo(1)
    try:
        group.sleep(3.0).result(timeout=0.5)
    except CallTimeoutError as exc:
        out["timeout"] = {"ranks": exc.ranks, "text": str(exc)}
    group.sleep(0).result()  # the 3 s sleeps finish first: calls to one rank stay in order
    pids = pool.pids()
    pending = group.sleep(20.0)
    time.sleep(1.0)
    os.kill(pids[2], signal.SIGKILL)
    started = time.time()
    try:
        pending.result(timeout=30)
        out["killed"] = "no error"
    except WorkerDiedError as exc:
        out["killed"] = {"rank": exc.rank, "method": exc.method, "text": str(exc), "seconds": time.time() - started}
    try:
        group.echo(2)
        out["after_death"] = "no error"
    except WorkerDiedError as exc:
        out["after_death"] = str(exc)
    return out


def lost_node(backend: str, process_on_nodes: list[int], kill_node, timeout_s: float = 60) -> dict:
    """A call pending on every rank when ``kill_node(pool, group)`` takes a node away: it must fail, naming the node."""
    pool = ResourcePool(process_on_nodes, backend=backend)
    group = WorkerGroup(pool, ScenarioWorker, role="victim", call_timeout_s=timeout_s)
    out = {"where": group.where(), "rank_nodes": list(pool.hosts.rank_nodes)}
    pending = group.sleep(120.0)
    time.sleep(1.0)
    out["killed_node"] = kill_node(pool, group)
    started = time.time()
    try:
        pending.result()
        out["error"] = "no error"
    except (WorkerDiedError, CallTimeoutError) as exc:
        out["error"] = {"type": type(exc).__name__, "text": str(exc), "seconds": time.time() - started}
    return out


def _kill_by_signal(pool, group) -> str:
    """Under torchrun the test kills the other node's launcher: say so, then wait for it."""
    print("HYBRIDFLOW-TEST: calls pending, kill the node now", flush=True)
    return "killed by the test"


def where(backend: str) -> dict:
    pool = ResourcePool([int(os.environ.get("WORLD_SIZE", "4"))], backend=backend)
    group = WorkerGroup(pool, ScenarioWorker, role="where")
    return {"where": group.where(), "rank_nodes": list(pool.hosts.rank_nodes), "echo": group.echo(7)}


def controller_leaves(backend: str) -> dict:
    """Rank 0's program ends (os._exit(0) below) while every other rank is inside a two-minute call."""
    pool = ResourcePool([int(os.environ["WORLD_SIZE"])], backend=backend)
    group = WorkerGroup(pool, ScenarioWorker, role="abandoned")
    group.sleep(120.0)
    time.sleep(1.0)
    return {"left_at": time.time()}


def lost_node_torchrun(backend: str) -> dict:
    return lost_node(backend, [int(os.environ["WORLD_SIZE"])], _kill_by_signal)


SCENARIOS = {"modes": modes, "colocated_and_split": colocated_and_split, "faults": faults,
             "lost_node": lost_node_torchrun, "where": where, "controller_leaves": controller_leaves}

if __name__ == "__main__":
    name, path = sys.argv[1], sys.argv[2]
    result = SCENARIOS[name]("torchrun")
    with open(path, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    if name in ("faults", "lost_node", "controller_leaves"):
        # A rank is gone, and with it the group's collectives; leave at once (a lost node fails the job).
        os._exit(3 if name == "lost_node" else 0)
    exit_process(0)  # skip the interpreter's seconds of teardown (torch's operator registry)
