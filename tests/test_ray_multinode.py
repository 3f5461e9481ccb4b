"""A Ray cluster of three nodes on this machine (separate raylets on 127.0.0.11-13) that pools join by address.

Pools spread their entries over nodes and form one torch.distributed world across them; a pool or a job
placement the cluster cannot hold is refused before any worker starts, naming the nodes; the demo's PPO job
trains with its actor on 2 nodes x 2 processes and gives the same numbers as over two torchrun launchers;
a node that dies under a pending call fails it within seconds, naming the node and its ranks (last here:
it takes a node away).
"""

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import time

import psutil
import pytest
import ray

import group_scenarios
from conftest import ROOT, free_port
from controller import ResourcePool, WorkerGroup
from controller.config import ConfigError, check_config, load_config
from controller.runtime.ray_backend import cluster_for, ensure_ray
from loopback_cluster import LoopbackCluster

NODES = ["127.0.0.11", "127.0.0.12", "127.0.0.13"]


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()  # the session's private cluster; later tests start a new one when they need it
    saved = os.environ.get("HYBRIDFLOW_NODE_IP")
    os.environ["HYBRIDFLOW_NODE_IP"] = NODES[0]  # the driver runs on the head node
    loopback = LoopbackCluster(NODES, cpus_per_node=4)
    try:
        ensure_ray(loopback.address)
        yield loopback
    finally:
        ray.shutdown()
        loopback.shutdown()
        if saved is None:
            os.environ.pop("HYBRIDFLOW_NODE_IP", None)
        else:
            os.environ["HYBRIDFLOW_NODE_IP"] = saved


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def remote_hosts(pids) -> set[str]:
    """Every remote address the processes have a TCP connection to."""
    hosts = set()
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.raddr:
                hosts.add(conn.raddr.ip.removeprefix("::ffff:"))
    return hosts


def test_the_cluster_is_one_raylet_per_node_all_on_loopback(cluster):
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert sorted(n["NodeManagerAddress"] for n in nodes) == NODES
    assert len({n["NodeID"] for n in nodes}) == 3
    pids = cluster.raylet_pids()
    assert len(set(pids.values())) == 3 and all(psutil.pid_exists(pid) for pid in pids.values())
    gcs_host = cluster.address.rsplit(":", 1)[0]
    assert gcs_host == NODES[0]
    assert all(is_loopback(host) for host in remote_hosts([os.getpid(), *pids.values()]))


def test_pools_spread_over_nodes_and_form_one_world(cluster):
    pool = ResourcePool([2, 2], backend="ray", ray_address=cluster.address)
    try:
        where = WorkerGroup(pool, group_scenarios.ScenarioWorker, role="where").where()
        node_ids = [w["ray_node_id"] for w in where]
        assert node_ids[0] == node_ids[1] and node_ids[2] == node_ids[3] and node_ids[0] != node_ids[2]
        assert pool.hosts.rank_nodes == [w["node_ip"] for w in where]
        assert set(pool.hosts.rank_nodes) <= set(NODES) and len(set(pool.hosts.rank_nodes)) == 2
        assert {w["world_sum"] for w in where} == {10.0}  # 1+2+3+4 over gloo across the nodes
        assert all(is_loopback(host) for host in remote_hosts([w["pid"] for w in where]))
    finally:
        pool.shutdown()
    pool = ResourcePool([1, 1, 1], backend="ray", ray_address=cluster.address)
    try:
        where = WorkerGroup(pool, group_scenarios.ScenarioWorker, role="where").where()
        assert sorted(w["node_ip"] for w in where) == NODES
    finally:
        pool.shutdown()
    started = time.time()
    with pytest.raises(RuntimeError, match=r"could not reserve \[2, 2, 2, 2\] bundles of \{'CPU': 1\}.*"
                                           r"the cluster has 3 node\(s\): 127\.0\.0\.1\d \(4 CPU, 0 GPU\)"):
        ResourcePool([2, 2, 2, 2], backend="ray", ray_address=cluster.address, init_timeout_s=60)
    assert time.time() - started < 10  # refused at once, not after the timeout


def test_a_job_placement_the_cluster_cannot_hold_is_refused_before_any_worker_starts(cluster):
    nodes = cluster_for(cluster.address)
    assert sorted(n.address for n in nodes) == NODES and {n.cpus for n in nodes} == {4.0}
    job = ["trainer.launcher=ray", f"trainer.ray_address={cluster.address}", "trainer.nnodes=2", "trainer.nproc=2",
           "critic.engine.tensor_parallel=1", "critic.engine.pipeline_parallel=1", "critic.engine.micro_batch_size=4"]
    check_config(load_config(ROOT / "examples/ppo_tiny.yaml", [*job, "trainer.placement={critic: 4}"]), cluster=nodes)
    # 2 x 2 for the default pool leaves 2 CPUs on two nodes and 4 on one: a critic on 2 nodes x 4 cannot fit.
    wide = load_config(ROOT / "examples/ppo_tiny.yaml", [*job, "trainer.placement={critic: {nodes: 2, processes_per_node: 4}}"])
    with pytest.raises(ConfigError, match=r"pool 'critic' \(2 node\(s\) x 4 process\(es\)\) needs 2 different node\(s\).*"
                                          r"it has 3 node\(s\): 127\.0\.0\.11 \(4 CPU, 0 GPU\), 127\.0\.0\.12"):
        check_config(wide, cluster=nodes)
    # The CLI joins the cluster (here by trainer.ray_address=auto: RAY_ADDRESS names it) and refuses the job
    # before any worker process starts.
    groups_before = len(ray.util.placement_group_table())  # every group ever made in the cluster, removed ones too
    job[1] = "trainer.ray_address=auto"
    proc = subprocess.run([sys.executable, "-m", "controller.cli", "train", "--config", "examples/ppo_tiny.yaml", *job,
                           "trainer.placement={critic: {nodes: 2, processes_per_node: 4}}", "trainer.run_dir=/tmp/hf-refused"],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT),
                          env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": cluster.address})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"joined the Ray cluster at {cluster.address}: 3 node(s)" in proc.stderr, proc.stderr[-3000:]
    assert "pool 'critic' (2 node(s) x 4 process(es)) needs 2 different node(s)" in proc.stderr, proc.stderr[-3000:]
    assert len(ray.util.placement_group_table()) == groups_before  # no pool was reserved: no worker started


def test_without_an_address_a_driver_starts_its_own_cluster_whatever_runs_here(cluster, tmp_path):
    # RAY_ADDRESS names the running cluster, and cluster_utils left its address file in Ray's temp dir: a
    # driver that names no address still gets a private cluster of one node (the README's worker example runs
    # this way, its address file pointing at a cluster that is gone: test_docs_examples).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": cluster.address}
    env.pop("HYBRIDFLOW_NODE_IP")
    probe = ("from controller.runtime.ray_backend import ensure_ray, cluster_nodes\n"
             "ensure_ray()\n"
             "print('NODES', [n['address'] for n in cluster_nodes()])\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NODES ['127.0.0.2']" in proc.stdout, proc.stdout
    # With an address, the driver joins and says so.
    joined = subprocess.run([sys.executable, "-c", probe.replace("ensure_ray()", f"ensure_ray({cluster.address!r})")],
                            capture_output=True, text=True, timeout=120, env={**env, "HYBRIDFLOW_NODE_IP": NODES[0]},
                            cwd=str(ROOT))
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert f"joined the Ray cluster at {cluster.address}: 3 node(s)" in joined.stderr
    assert sorted(eval(joined.stdout.split("NODES", 1)[1])) == NODES


# The demo's job (examples/ppo_tiny.yaml: PPO, actor and critic at TP2 x PP2), shortened, generating with the
# megatron rollout at the same layout (vLLM under Ray is test_train_cli's GRPO runs; it starts in several times the time).
DEMO_JOB = ["trainer.nnodes=2", "trainer.nproc=2", "data.batch_size=8", "data.train_size=64", "data.val_size=8",
            "rollout.engine=megatron", "rollout.tensor_parallel=2", "rollout.pipeline_parallel=2",
            "ppo.ppo_mini_batch_size=8", "critic_ppo.ppo_mini_batch_size=8", "rollout.sampling.max_new_tokens=4",
            "trainer.total_steps=1", "trainer.val_every=0", "trainer.save_every=0", "trainer.logger=[jsonl]",
            "trainer.export_hf=false", "trainer.plots=false"]
COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss",
            "critic/advantages/mean", "rollout/logprob_diff_max")


def train_command(run_dir, model, *overrides) -> list[str]:
    return [sys.executable, "-m", "controller.cli", "train", "--config", "examples/ppo_tiny.yaml",
            f"trainer.run_dir={run_dir}", f"model_path={model}", *DEMO_JOB, *overrides]


def read_steps(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_demo_job_on_two_nodes_trains_alike_on_ray_and_on_two_torchrun_launchers(cluster, tmp_path):
    from controller.models.builtin import resolve_model_path

    model = resolve_model_path("builtin:tiny-arithmetic", tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ray_run = tmp_path / "ray"
    proc = subprocess.run(train_command(ray_run, model, "trainer.launcher=ray", f"trainer.ray_address={cluster.address}"),
                          capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert f"joined the Ray cluster at {cluster.address}: 3 node(s)" in proc.stderr
    placed = re.search(r"Ray pool of the actor and colocated roles: 4 processes on 2 node\(s\): "
                       r"(127\.0\.0\.1\d) \(ranks \[0, 1\]\), (127\.0\.0\.1\d) \(ranks \[2, 3\]\)", proc.stderr)
    assert placed and placed.group(1) != placed.group(2), proc.stderr[-3000:]
    # Each node runs the same command; the two hybridflow processes launch one torchrun each, meeting at c10d.
    port = free_port()
    torchrun_run = tmp_path / "torchrun"
    command = train_command(torchrun_run, model, "trainer.launcher=torchrun", f"trainer.rdzv_endpoint=127.0.0.1:{port}")
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT),
                              env={**env, "HYBRIDFLOW_NODE_IP": "127.0.0.1"}) for _ in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[0][-2000:] + o[1][-4000:] for o in outputs)
    on_ray, on_torchrun = read_steps(ray_run), read_steps(torchrun_run)
    assert [s["step"] for s in on_ray] == [s["step"] for s in on_torchrun] == [1]
    for ray_step, torchrun_step in zip(on_ray, on_torchrun):
        for key in COMPARED:
            assert ray_step[key] == pytest.approx(torchrun_step[key], rel=1e-5, abs=1e-6), (key, ray_step, torchrun_step)


def test_a_lost_node_fails_the_pending_call_naming_the_node_and_its_ranks(cluster):
    def kill_a_worker_node(pool, group) -> str:
        victim = next(ip for ip in pool.hosts.rank_nodes if ip != cluster.head_ip)
        cluster.kill_node(victim)
        return victim

    out = group_scenarios.lost_node("ray", [2, 2], kill_a_worker_node)
    victim = out["killed_node"]
    ranks = [r for r, ip in enumerate(out["rank_nodes"]) if ip == victim]
    error = out["error"]
    assert isinstance(error, dict) and error["type"] == "WorkerDiedError", error
    assert error["seconds"] < 15, error
    assert f"on node {victim} (which runs ranks {ranks})" in error["text"], error
    assert "during 'sleep'" in error["text"] and "its Ray actor died" in error["text"]


# GRPO with the actor at DP2 over 2 nodes x 1 process (fp32, the megatron rollout), a checkpoint every step.
RESTART_JOB = ["--config", "examples/ppo_tiny.yaml", "algorithm.name=grpo", "rollout.sampling.n=2", "trainer.nproc=1",
               "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1", "actor.engine.precision=fp32",
               "actor.engine.micro_batch_size=4", "data.batch_size=8", "ppo.ppo_mini_batch_size=16",
               "ppo.ppo_epochs=1", "rollout.engine=megatron", "rollout.sampling.max_new_tokens=4",
               "trainer.total_steps=4", "trainer.save_every=1", "trainer.val_every=0", "trainer.logger=[jsonl]",
               "trainer.export_hf=false", "trainer.plots=false", "data.train_size=64", "data.val_size=8",
               "trainer.launcher=ray"]
TIMED = ("timing_s/", "perf/", "rollout/tokens_per_s", "job/")  # measured, not computed: not compared


def test_a_node_killed_mid_step_restarts_the_job_on_the_other_at_half_the_data_parallel_size(cluster, tmp_path):
    """trainer.max_restarts 1 on a cluster of two nodes: the node other than the head (the driver's) is killed
    once step 2 is logged, with one of the job's two ranks (whatever step it lands in). The job restarts on the head node at DP 1 with the global batch kept (twice the micro-batches a
    rank), finishes its 4 steps, and from the checkpoint it resumed from gives exactly what an uninterrupted
    run at DP 1 from that checkpoint gives."""
    from controller.models.builtin import resolve_model_path
    from tools.fault_drill import Drill

    for spare in [ip for ip in cluster.nodes if ip != cluster.head_ip][1:]:  # two nodes: the head and one other
        cluster.kill_node(spare)
    victim = next(ip for ip in cluster.nodes if ip != cluster.head_ip)
    model = resolve_model_path("builtin:tiny-arithmetic", tmp_path / "model")
    command = [sys.executable, "-m", "controller.cli", "train", *RESTART_JOB, f"trainer.ray_address={cluster.address}",
               f"model_path={model}"]
    run = tmp_path / "run"
    drill = Drill([*command, f"trainer.run_dir={run}", "trainer.nnodes=2", "trainer.max_restarts=1"], run)
    try:
        drill.wait(lambda: 2 in drill.steps(), "step 2")
        # The kill lands when it lands: on a loaded machine step 3 may be done and checkpointed first, and the
        # restart resumes there. The drill waits for the first step after the one resumed at, whichever it is.
        drill.fault("node", lambda: cluster.kill_node(victim), found="[hybridflow] the job failed")
        code = drill.finish()
    finally:
        drill.kill()
    out = drill.text()
    assert code == 0, out[-6000:]
    assert re.search(r"Ray pool of the actor and colocated roles: 2 processes on 2 node\(s\)", out)
    assert f"on node {victim}" in out  # the failure names the lost node
    assert drill.times["node"]["found_s"] < 15, drill.times
    assert ("[hybridflow] restart 1 (at most 1 within 3600 s): 1 healthy node(s) of 2; resuming from the newest "
            "complete checkpoint at data-parallel size 1 instead of 2: the global batch of 16 sequences is kept, 16 "
            "sequences a rank in 4 micro-batches of 4 instead of 8 sequences a rank in 2 micro-batches of 4") in out
    assert re.search(r"Ray pool of the actor and colocated roles: 1 processes on 1 node\(s\): "
                     + re.escape(cluster.head_ip), out), out[-4000:]
    resumed = int(re.findall(r"resumed at step (\d+)", out)[-1])
    assert resumed >= 1
    steps = drill.records()
    assert [s["step"] for s in steps] == [1, 2, 3, 4]  # one metrics file, continued
    assert [s.get("job/data_parallel") for s in steps] == [None] * resumed + [1.0] * (4 - resumed)
    (record,) = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert record["details"]["data_parallel"] == [2, 1] and record["details"]["nodes"] == [cluster.head_ip]

    # The reference: the checkpoint the restart resumed from, resumed at one node without interruption.
    reference = tmp_path / "reference"
    shutil.copytree(run, reference)
    for path in (reference / "checkpoints").glob("*/step_*"):
        if int(path.name.removeprefix("step_").split(".")[0]) > resumed:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    (reference / "checkpoints" / "trainer" / "latest").write_text(f"step_{resumed:08d}.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    again = subprocess.run([*command, f"trainer.run_dir={reference}", "trainer.nnodes=1", "trainer.resume=true"],
                           capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT))
    assert again.returncode == 0, again.stderr[-5000:]
    for restarted, uninterrupted in zip(steps[resumed:], read_steps(reference)[resumed:], strict=True):
        compared = [k for k in uninterrupted if not k.startswith(TIMED)]
        assert len(compared) > 20 and all(restarted[k] == uninterrupted[k] for k in compared), (restarted, uninterrupted)
