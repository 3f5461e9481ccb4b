"""Render the sbatch script that runs a hybridflow job on several Slurm nodes, under Ray or torchrun.

    python tools/slurm/render.py ray --config examples/gpu_grpo.yaml --nodes 2 --nproc-per-node 8 \\
        --partition gpu --time 04:00:00 --env GLOO_SOCKET_IFNAME=ib0 --out grpo.sbatch -- trainer.total_steps=200
    sbatch grpo.sbatch

The script is one of the templates next to this file (ray.sbatch.in, torchrun.sbatch.in) with its
``@NAME@`` fields filled: the #SBATCH lines (one task per node), the collectives' environment block from
hybridengine/device/cluster_env.py (``--env NAME=VALUE`` sets an entry, or adds one), and the job's
values. The config is loaded and checked here, with the launcher and the node and process counts the
script will give it, so a job that cannot run fails now rather than in the queue. ``render(...)`` is the
same as a function.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

import hostlist

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from controller.config import ConfigError, check_config, load_config  # noqa: E402
from hybridengine.device.cluster_env import cluster_env_lines  # noqa: E402

__all__ = ["DEFAULT_NODE_IP_COMMAND", "DEFAULT_PORTS", "RenderError", "TEMPLATES", "expand_nodelist", "main", "render"]

TEMPLATES = {"ray": "ray.sbatch.in", "torchrun": "torchrun.sbatch.in"}
DEFAULT_PORTS = {"ray": 6379, "torchrun": 29500}  # the Ray head's GCS port; the c10d rendezvous'
DEFAULT_NODE_IP_COMMAND = "hostname -I | awk '{print $1}'"
# Set by the script from the allocation and the rendered values, not by the user's overrides.
SCRIPT_KEYS = ("trainer.launcher", "trainer.nnodes", "trainer.nproc", "trainer.ray_address", "trainer.rdzv_endpoint")
_FIELD = re.compile(r"@([A-Z_]+)@")


class RenderError(ValueError):
    """The job cannot be rendered; the message names the bad value and what is valid."""


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's hostlist syntax expanded, e.g. ``gpu[01-03,07],cpu5`` -> gpu01 gpu02 gpu03 gpu07 cpu5."""
    try:
        return hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as exc:
        raise RenderError(f"--nodelist {nodelist!r} is not a Slurm node list ({exc}); "
                          "e.g. gpu[01-03,07],cpu5") from None


def render(
    launcher: str,
    config: str | Path,
    nodes: int,
    nproc_per_node: int,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    nodelist: str | None = None,
    gpus_per_node: int | None = None,
    cpus_per_task: int | None = None,
    partition: str | None = None,
    account: str | None = None,
    time: str | None = None,
    job_name: str | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    node_ip_command: str = DEFAULT_NODE_IP_COMMAND,
    job_log: str = "%x-%j.out",
    ray_wait_s: int = 300,
) -> str:
    """The sbatch script's text. ``gpus_per_node`` defaults to one GPU per process (0: CPU nodes);
    ``cpus_per_task`` unset leaves the node's CPU count to Slurm's default for the task."""
    if launcher not in TEMPLATES:
        raise RenderError(f"launcher {launcher!r} is not one of {sorted(TEMPLATES)}")
    gpus_per_node = nproc_per_node if gpus_per_node is None else gpus_per_node
    port = DEFAULT_PORTS[launcher] if port is None else port
    for name, value, least in (("--nodes", nodes, 1), ("--nproc-per-node", nproc_per_node, 1),
                               ("--gpus-per-node", gpus_per_node, 0), ("--ray-wait-s", ray_wait_s, 1)):
        if value < least:
            raise RenderError(f"{name} must be >= {least}, got {value}")
    if cpus_per_task is not None and cpus_per_task < 1:
        raise RenderError(f"--cpus-per-task must be >= 1, got {cpus_per_task}")
    if not 1 <= port <= 65535:
        raise RenderError(f"--port must be in [1, 65535], got {port}")
    names = expand_nodelist(nodelist) if nodelist is not None else []
    if nodelist is not None and len(names) != nodes:
        raise RenderError(f"--nodelist {nodelist!r} names {len(names)} node(s) ({' '.join(names)}), "
                          f"but --nodes is {nodes}")
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise RenderError(f"override {item!r} is not of the form key.sub=value")
        if key in SCRIPT_KEYS:
            raise RenderError(f"override {item!r}: the script sets {key} (from the launcher, --nodes, "
                              "--nproc-per-node and the allocation's first node)")
    if not Path(config).is_file():
        raise RenderError(f"config file {config} does not exist")
    # The job's first node: known here only from --nodelist, and only the address's form is checked.
    head = names[0] if names else "head-node"
    _check_job_config(config, list(overrides), launcher, nodes, nproc_per_node, f"{head}:{port}")
    try:
        env_lines = cluster_env_lines(env)
    except ValueError as exc:
        raise RenderError(f"--env: {exc}") from None

    sbatch = {"job-name": job_name or f"hybridflow-{launcher}", "nodes": nodes, "ntasks-per-node": 1,
              "gpus-per-node": gpus_per_node or None, "cpus-per-task": cpus_per_task, "partition": partition,
              "account": account, "time": time, "nodelist": nodelist, "output": job_log}
    fields = {
        "SBATCH": "\n".join(f"#SBATCH --{key}={value}" for key, value in sbatch.items() if value is not None),
        "ENV": "\n".join(env_lines),
        "CONFIG": shlex.quote(str(config)),
        "OVERRIDES": " ".join(shlex.quote(item) for item in overrides),
        "NPROC_PER_NODE": str(nproc_per_node),
        "GPUS_PER_NODE": str(gpus_per_node),
        "CPUS_PER_NODE": "" if cpus_per_task is None else str(cpus_per_task),
        "PORT": str(port),
        "RAY_WAIT_S": str(ray_wait_s),
        "NODE_IP_COMMAND": _bash_word(node_ip_command),
    }
    template = (Path(__file__).parent / TEMPLATES[launcher]).read_text()
    return _FIELD.sub(lambda match: fields[match.group(1)], template)


def _bash_word(value: str) -> str:
    """``value`` as one bash word: single-quoted, or double-quoted with escapes where it holds a single quote."""
    if "'" not in value:
        return shlex.quote(value)
    return '"' + re.sub(r'([\\$"`])', r"\\\1", value) + '"'


def _check_job_config(config: str | Path, overrides: list[str], launcher: str, nodes: int, nproc: int,
                      head_address: str) -> None:
    """``check_config`` on the config with the trainer keys the script will give it."""
    address_key = {"ray": "trainer.ray_address", "torchrun": "trainer.rdzv_endpoint"}[launcher]
    job = [f"trainer.launcher={launcher}", f"trainer.nnodes={nodes}", f"trainer.nproc={nproc}",
           f"{address_key}={head_address}"]
    try:
        check_config(load_config(config, [*overrides, *job]))
    except ConfigError as exc:
        raise RenderError(f"config {config}, as the job runs it ({launcher}, {nodes} node(s) x {nproc} "
                          f"processes): {exc}") from None


def _env_pair(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{item!r} is not NAME=VALUE")
    return name, value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="render.py", description="Write the sbatch script for a multi-node hybridflow job.",
        epilog="Overrides after -- (key.sub=value) are passed on to `hybridflow train`.")
    parser.add_argument("launcher", metavar="{ray,torchrun}", help="trainer.launcher of the job")
    parser.add_argument("--config", required=True, help="the job's YAML config (examples/*.yaml)")
    parser.add_argument("--nodes", type=int, required=True, help="nodes of the allocation (trainer.nnodes)")
    parser.add_argument("--nodelist", help="the nodes by name, Slurm syntax: gpu[01-03,07]")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="processes per node (trainer.nproc)")
    parser.add_argument("--gpus-per-node", type=int, help="default: --nproc-per-node; 0: CPU nodes")
    parser.add_argument("--cpus-per-task", type=int, help="CPUs of each node's task (Ray: the node's CPUs)")
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--time", help="the job's time limit, e.g. 04:00:00")
    parser.add_argument("--job-name", help="default: hybridflow-LAUNCHER")
    parser.add_argument("--port", type=int, help=f"the Ray head's or the rendezvous' port; default {DEFAULT_PORTS}")
    parser.add_argument("--env", type=_env_pair, action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of the job (repeatable): hybridengine/device/cluster_env.py")
    parser.add_argument("--node-ip-command", default=DEFAULT_NODE_IP_COMMAND,
                        help="a shell command printing the address the other nodes reach a node at; "
                             "default %(default)r")
    parser.add_argument("--job-log", default="%x-%j.out", help="#SBATCH --output; default %(default)s")
    parser.add_argument("--ray-wait-s", type=int, default=300, help="Ray: how long the nodes may take to join")
    parser.add_argument("--out", help="the script's path; default: stdout")
    parser.add_argument("overrides", nargs="*", help="key.sub=value for hybridflow train")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    try:
        script = render(
            args.launcher, args.config, args.nodes, args.nproc_per_node, overrides=args.overrides,
            nodelist=args.nodelist, gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
            partition=args.partition, account=args.account, time=args.time, job_name=args.job_name, port=args.port,
            env=dict(args.env), node_ip_command=args.node_ip_command, job_log=args.job_log,
            ray_wait_s=args.ray_wait_s)
    except RenderError as exc:
        parser.error(str(exc))
    if args.out:
        Path(args.out).write_text(script)
        Path(args.out).chmod(0o755)
    else:
        sys.stdout.write(script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
