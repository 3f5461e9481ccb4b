"""Real torchrun groups: the same scenarios as the Ray tests, launched by torchrun on CPU."""

import json
import time


import group_checks
from conftest import TESTS, run_torchrun


def run_scenario(name: str, nproc: int, tmp_path, monitor_interval: float = 0.5):
    out = tmp_path / f"{name}.json"
    proc = run_torchrun(TESTS / "group_scenarios.py", [name, str(out)], nproc, monitor_interval=monitor_interval)
    assert out.exists(), f"torchrun exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc, json.loads(out.read_text())


def test_every_dispatch_mode_under_torchrun(tmp_path):
    proc, out = run_scenario("modes", 4, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    group_checks.check_modes(out)


def test_colocated_roles_and_split_pools_under_torchrun(tmp_path):
    proc, out = run_scenario("colocated_and_split", 4, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    group_checks.check_colocated_and_split(out)


def test_raised_exception_timeout_and_killed_worker_under_torchrun(tmp_path):
    # torchrun tears the whole job down once it sees a dead rank; give the
    # controller time to report it first, as the README advises.
    _, out = run_scenario("faults", 3, tmp_path, monitor_interval=5)
    group_checks.check_faults(out)


def test_pool_larger_than_the_torchrun_world_is_refused(tmp_path):
    script = tmp_path / "too_big.py"
    script.write_text(
        "from controller import ResourcePool\n"
        "try:\n"
        "    ResourcePool([3])\n"
        "except ValueError as exc:\n"
        "    print('REFUSED:', exc)\n"
    )
    proc = run_torchrun(script, [], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED: resource pool asks for 3 processes but torchrun started WORLD_SIZE=2" in proc.stdout


def test_ranks_busy_in_a_call_exit_when_the_controller_is_gone(tmp_path):
    # Rank 0 leaves with status 0, so torchrun would wait for the other ranks' two-minute sleep: they notice
    # the closed control connection and leave within seconds.
    started = time.time()
    proc, out = run_scenario("controller_leaves", 3, tmp_path)
    assert time.time() - out["left_at"] < 20 and time.time() - started < 90, proc.stderr[-3000:]
    assert proc.stderr.count("the controller (rank 0) went away during a call; exiting") == 2, proc.stderr[-3000:]
