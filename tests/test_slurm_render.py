"""tools/slurm/render.py: the sbatch scripts it writes, run under bash on a fake three-node allocation.

The fake cluster is a directory of shim commands first on PATH (scontrol, srun, hostname, ray,
hybridflow): each logs its call (arguments, the node it runs on, HYBRIDFLOW_NODE_IP) to calls.jsonl and
acts as cluster.json says. srun runs its command on each target node in turn with SLURMD_NODENAME set,
hostname -I answers that node's address, and `ray status` counts the `ray start` calls logged so far.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridengine.device.cluster_env import CLUSTER_ENV, cluster_env_lines
from tools.slurm.render import RenderError, expand_nodelist, main, render

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "examples" / "ppo_tiny.yaml")
NODES = {"gpu01": "10.0.0.1", "gpu02": "10.0.0.2", "gpu03": "10.0.0.3"}
# ppo_tiny's batch re-split so its TP=2 x PP=2 layout fits 3 nodes x 8 processes (DP 6).
OVERRIDES = ["data.batch_size=48", "ppo.ppo_mini_batch_size=48", "critic_ppo.ppo_mini_batch_size=48"]
JOB = dict(nodelist="gpu[01-03]", overrides=OVERRIDES, cpus_per_task=16, env={"GLOO_SOCKET_IFNAME": "ib0"})

SHIM = '''#!{python} -S
import json, os, subprocess, sys
from pathlib import Path

here = Path(__file__).parent
cluster = json.loads((here / "cluster.json").read_text())
prog, args, node = Path(sys.argv[0]).name, sys.argv[1:], os.environ.get("SLURMD_NODENAME")
call = {{"prog": prog, "args": args, "node": node, "ip": os.environ.get("HYBRIDFLOW_NODE_IP"),
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "ray_auth": [os.environ.get("RAY_AUTH_MODE"), os.environ.get("RAY_AUTH_TOKEN")]}}
with open(here / "calls.jsonl", "a") as log:
    log.write(json.dumps(call) + "\\n")

if prog == "scontrol":  # scontrol show hostnames LIST
    print("\\n".join(cluster["nodes"]))
elif prog == "hostname":  # hostname -I: the cluster network's address first
    print(cluster["nodes"][node], "172.17.0.1")
elif prog == "srun":
    opts, i = {{}}, 0
    while args[i].startswith("-"):
        if args[i] == "-w":
            opts["-w"], i = args[i + 1], i + 2
        else:
            key, _, value = args[i].partition("=")
            opts[key], i = value, i + 1
    targets = [opts["-w"]] if "-w" in opts else list(cluster["nodes"])[:int(opts["--nodes"])]
    codes = [subprocess.run(args[i:], env={{**os.environ, "SLURMD_NODENAME": target}}).returncode for target in targets]
    sys.exit(max(codes))
elif prog == "ray" and args[0] == "status":
    calls = [json.loads(line) for line in (here / "calls.jsonl").read_text().splitlines()]
    joined = min(cluster["ray_nodes_max"], sum(c["prog"] == "ray" and c["args"][0] == "start" for c in calls))
    if not joined:
        sys.exit("ConnectionError: could not find any running Ray instance")
    print("======== Autoscaler status: 2026-01-01 00:00:00 ========\\nNode status\\n" + "-" * 56)
    print("Active:\\n 1 head\\nIdle:\\n" + (f" {{joined - 1}} worker" if joined > 1 else " (no idle nodes)"))
    print("Pending:\\n (no pending nodes)\\nRecent failures:\\n (no failures)\\n\\nResources\\n" + "-" * 56)
    print("Total Usage:\\n 0.0/48.0 CPU\\n 0.0/24.0 GPU")
elif prog == "hybridflow":
    sys.exit(cluster["train_exit"])
'''


def run_job(tmp_path: Path, script: str, train_exit: int = 0, ray_nodes_max: int = len(NODES)):
    """Run ``script`` on the fake allocation; (the completed bash, the calls logged in order)."""
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "cluster.json").write_text(json.dumps({"nodes": NODES, "train_exit": train_exit,
                                                    "ray_nodes_max": ray_nodes_max}))
    (shims / "calls.jsonl").write_text("")
    for prog in ("scontrol", "srun", "hostname", "ray", "hybridflow"):
        (shims / prog).write_text(SHIM.format(python=sys.executable))
        (shims / prog).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script)
    # The batch script runs on the allocation's first node.
    env = {"PATH": f"{shims}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_JOB_NUM_NODES": "3", "SLURMD_NODENAME": "gpu01"}
    done = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    calls = [json.loads(line) for line in (shims / "calls.jsonl").read_text().splitlines()]
    return done, calls


def of(calls, prog):
    return [c for c in calls if c["prog"] == prog]


def sbatch_lines(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]


def test_sbatch_lines_and_environment_block():
    script = render("torchrun", CONFIG, 3, 8, partition="gpu", account="rl", time="04:00:00", **JOB)
    assert sbatch_lines(script) == [
        "--job-name=hybridflow-torchrun", "--nodes=3", "--ntasks-per-node=1", "--gpus-per-node=8",
        "--cpus-per-task=16", "--partition=gpu", "--account=rl", "--time=04:00:00", "--nodelist=gpu[01-03]",
        "--output=%x-%j.out",
    ]
    assert "\n".join(cluster_env_lines({"GLOO_SOCKET_IFNAME": "ib0"})) in script
    # CPU nodes: no GPUs asked for; optional lines left out.
    cpu = render("ray", CONFIG, 3, 8, gpus_per_node=0, job_name="grpo", overrides=OVERRIDES)
    assert sbatch_lines(cpu) == ["--job-name=grpo", "--nodes=3", "--ntasks-per-node=1", "--output=%x-%j.out"]
    assert "gpus_per_node=0\n" in cpu


def test_ray_script_starts_the_cluster_then_the_driver(tmp_path):
    done, calls = run_job(tmp_path, render("ray", CONFIG, 3, 8, **JOB))
    assert done.returncode == 0, done.stderr
    assert of(calls, "scontrol")[0]["args"] == ["show", "hostnames", "gpu[01-03]"]
    starts = [c for c in of(calls, "ray") if c["args"][0] == "start"]
    head = [c for c in starts if "--head" in c["args"]]
    assert len(head) == 1 and head[0]["node"] == "gpu01" and head[0]["ip"] == "10.0.0.1"
    assert {"--node-ip-address=10.0.0.1", "--port=6379", "--num-cpus=16", "--num-gpus=8", "--disable-usage-stats",
            "--block"} <= set(head[0]["args"])
    others = [c for c in starts if "--head" not in c["args"]]
    assert sorted(c["node"] for c in others) == ["gpu02", "gpu03"]
    for c in others:
        assert {"--address=10.0.0.1:6379", f"--node-ip-address={NODES[c['node']]}", "--num-gpus=8",
                "--block"} <= set(c["args"]) and c["ip"] == NODES[c["node"]]
    # One srun step per other node, pinned to it with -w.
    worker_steps = [c["args"] for c in of(calls, "srun") if "--address=10.0.0.1:6379" in c["args"]]
    assert sorted(a[a.index("-w") + 1] for a in worker_steps) == ["gpu02", "gpu03"]
    assert all({"--nodes=1", "--ntasks=1"} <= set(a) for a in worker_steps)
    assert any(c["args"][:3] == ["status", "--address", "10.0.0.1:6379"] for c in of(calls, "ray"))

    [driver] = of(calls, "hybridflow")
    assert driver["args"] == ["train", "--config", CONFIG, "trainer.launcher=ray", "trainer.ray_address=10.0.0.1:6379",
                              "trainer.nnodes=3", "trainer.nproc=8", *OVERRIDES]
    assert driver["node"] == "gpu01" and driver["ip"] == "10.0.0.1" and driver["gloo_ifname"] == "ib0"
    assert calls.index(driver) > max(calls.index(c) for c in starts)  # after every node joined
    # One fresh Ray token for the job, known to every node, `ray status` and the driver.
    [(mode, token)] = {tuple(c["ray_auth"]) for c in of(calls, "ray") + [driver]}
    assert mode == "token" and len(token) == 64 and int(token, 16)


def test_ray_script_exits_with_the_drivers_status(tmp_path):
    done, calls = run_job(tmp_path, render("ray", CONFIG, 3, 8, **JOB), train_exit=3)
    assert done.returncode == 3 and len(of(calls, "hybridflow")) == 1


def test_ray_script_fails_when_nodes_do_not_join(tmp_path):
    done, calls = run_job(tmp_path, render("ray", CONFIG, 3, 8, ray_wait_s=2, **JOB), ray_nodes_max=2)
    assert done.returncode == 1
    assert "2 of 3 Ray nodes joined 10.0.0.1:6379 within 2s" in done.stderr
    assert not of(calls, "hybridflow")


@pytest.mark.parametrize("train_exit", [0, 3])
def test_torchrun_script_runs_hybridflow_on_every_node(tmp_path, train_exit):
    done, calls = run_job(tmp_path, render("torchrun", CONFIG, 3, 8, port=29400, **JOB), train_exit=train_exit)
    assert done.returncode == train_exit, done.stderr
    [step] = [c["args"] for c in of(calls, "srun") if "--nodes=3" in c["args"]]
    assert {"--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1"} <= set(step)
    trains = of(calls, "hybridflow")
    assert [c["node"] for c in trains] == list(NODES)
    for c in trains:
        assert c["args"] == ["train", "--config", CONFIG, "trainer.launcher=torchrun", "trainer.nnodes=3",
                             "trainer.nproc=8", "trainer.rdzv_endpoint=10.0.0.1:29400", *OVERRIDES]
        assert c["ip"] == NODES[c["node"]] and c["gloo_ifname"] == "ib0"


@pytest.mark.parametrize("kwargs, message", [
    (dict(launcher="mpi"), r"launcher 'mpi' is not one of \['ray', 'torchrun'\]"),
    (dict(nodes=0, nodelist=None), r"--nodes must be >= 1, got 0"),
    (dict(nodelist="gpu[01-02]"), r"--nodelist 'gpu\[01-02\]' names 2 node\(s\) \(gpu01 gpu02\), but --nodes is 3"),
    (dict(nodelist="gpu[01-"), r"--nodelist 'gpu\[01-' is not a Slurm node list"),
    (dict(config="examples/no_such.yaml"), r"config file examples/no_such.yaml does not exist"),
    (dict(overrides=["trainer.total_steps"]), r"override 'trainer.total_steps' is not of the form key.sub=value"),
    (dict(overrides=["trainer.nnodes=2"]), r"override 'trainer.nnodes=2': the script sets trainer.nnodes"),
    (dict(nproc_per_node=3), r"tensor_parallel x pipeline_parallel = 4 does not divide"),
    (dict(env={"1X": "a"}), r"--env: environment variable name '1X' is not a shell variable name"),
])
def test_bad_input_is_refused(kwargs, message):
    job = dict(launcher="ray", config=CONFIG, nodes=3, nproc_per_node=8, **JOB) | kwargs
    with pytest.raises(RenderError, match=message):
        render(**job)


def test_cli_writes_the_script_or_refuses_before_writing(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    args = ["torchrun", "--config", CONFIG, "--nodes", "3", "--nproc-per-node", "8", "--out", str(out)]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--nodelist", "gpu[01-04]", "--", *OVERRIDES])
    assert exit_.value.code == 2 and not out.exists()
    assert "names 4 node(s) (gpu01 gpu02 gpu03 gpu04), but --nodes is 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--env", "GLOO_SOCKET_IFNAME"])
    assert "'GLOO_SOCKET_IFNAME' is not NAME=VALUE" in capsys.readouterr().err

    assert main([*args, "--env", "GLOO_SOCKET_IFNAME=ib0", "--env", "MY_SETTING=a b", "--", *OVERRIDES]) == 0
    assert out.read_text() == render("torchrun", CONFIG, 3, 8, overrides=OVERRIDES,
                                     env={"GLOO_SOCKET_IFNAME": "ib0", "MY_SETTING": "a b"})
    assert "export MY_SETTING='a b'\n" in out.read_text() and os.access(out, os.X_OK)


def test_nodelist_expansion():
    assert expand_nodelist("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert expand_nodelist("n[098-101]") == ["n098", "n099", "n100", "n101"]
    assert expand_nodelist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]


def test_cluster_env_lines():
    defaulted = [var for var in CLUSTER_ENV if var.default is not None]
    unset = [var for var in CLUSTER_ENV if var.default is None]
    assert defaulted and unset and "GLOO_SOCKET_IFNAME" in {var.name for var in unset}
    for var, line in zip(CLUSTER_ENV, cluster_env_lines(), strict=True):
        export = f"export {var.name}={var.default}" if var.default is not None else f"# export {var.name}="
        assert line.startswith(export + " ") and line.endswith(f"  # {var.reason}")

    first = defaulted[0]
    lines = cluster_env_lines({"GLOO_SOCKET_IFNAME": "ib0", first.name: "other", "MY_SETTING": "a b"})
    assert len(lines) == len(CLUSTER_ENV) + 1 and lines[-1] == "export MY_SETTING='a b'"
    names = [var.name for var in CLUSTER_ENV]
    assert lines[names.index("GLOO_SOCKET_IFNAME")].startswith("export GLOO_SOCKET_IFNAME=ib0 ")
    assert lines[CLUSTER_ENV.index(first)].startswith(f"export {first.name}=other ")
