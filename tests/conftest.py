import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
if str(ROOT) not in sys.path:  # tests of tools/ import them as the package `tools`
    sys.path.insert(0, str(ROOT))
# Tests run on the CPU path even where a GPU is visible, and never reach out.
os.environ.setdefault("HYBRIDFLOW_DEVICE", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a hub id resolves from a cache a test fills, or fails at once  # (Ray 2.60 ignores RAY_DISABLE_USAGE_STATS)

# The longest modules, longest first (seconds of one worker, measured on 2 cores: `--durations`, summed by
# module), started first: `make test` runs the suite on two pytest-xdist workers a module at a time, and a long
# module started last would leave one worker idle while the other finishes it. The rest keep pytest's order.
LONGEST_MODULES = [
    "test_train_cli.py", "test_sft_cli.py", "test_ray_multinode.py", "rollout/test_rollout_engines.py",
    "megatron/test_checkpoint_resume.py", "test_algorithm_cli.py", "faults/test_faults_cli.py",
    "test_long_context_e2e.py", "test_distillation_e2e.py", "test_judge_e2e.py", "serving/test_agent_cli.py", "test_one_step_off.py", "test_async_mode.py",
    "test_vision_train_e2e.py",
    "test_docs_examples.py",
    "test_examples.py", "test_sandbox.py", "megatron/test_sft_parity.py", "rollout/test_agent_rollout.py",
    "rollout/test_family_generation.py", "test_torchrun_groups.py", "serving/test_rollout_server.py",
    "megatron/test_critic_parity.py", "test_multinode.py", "test_researcher_api.py", "test_ray_groups.py",
    "megatron/test_actor_parity.py", "test_placed_dataflow.py",
    "megatron/test_moe_parity.py",
    "test_smollm2_pipeline.py", "megatron/test_hybrid_engine.py", "megatron/test_two_grids.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}

    def order(item):
        module = Path(str(item.fspath)).relative_to(TESTS).as_posix()
        return rank.get(module, len(LONGEST_MODULES))

    items.sort(key=order)  # stable: within a module, and among the others, pytest's order


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray cluster for the whole session (starting one costs seconds)."""
    import ray

    from controller.runtime.ray_backend import ensure_ray

    ensure_ray()
    yield
    ray.shutdown()


def run_torchrun(script: Path, args: list[str], nproc: int, timeout: float = 180, monitor_interval: float = 0.5):
    """Launch ``script`` under the real torchrun on CPU; returns the CompletedProcess."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc}", f"--monitor-interval={monitor_interval}",
        str(script), *args,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(TESTS))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_torchrun_nodes(command: list[str], nnodes: int, nproc_per_node: int, *, module: bool = False,
                         monitor_interval: float = 0.5, env: dict | None = None) -> list[subprocess.Popen]:
    """One torchrun launcher per simulated node, all on 127.0.0.1, meeting at a c10d rendezvous.

    Each launcher leads its own process session, so a test can take a whole
    node away (``os.killpg``). ``command``: a script and its arguments, or a
    module and its arguments with ``module=True``.
    """
    endpoint = f"127.0.0.1:{free_port()}"
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
              "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id=test-{endpoint}",
              "--local-addr=127.0.0.1", f"--monitor-interval={monitor_interval}", *(["-m"] if module else []), *command]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), "OMP_NUM_THREADS": "1",
           "HYBRIDFLOW_NODE_IP": "127.0.0.1", **(env or {})}
    return [subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             cwd=str(TESTS), start_new_session=True) for _ in range(nnodes)]
