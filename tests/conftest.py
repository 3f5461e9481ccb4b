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
os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray cluster for the whole session (starting one costs seconds)."""
    import ray

    from controller.ray_backend import ensure_ray

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
