"""Several nodes on one machine: torchrun launchers meeting at a c10d rendezvous, and a Ray cluster of
separate raylets, every address loopback.

torchrun: two launchers of 2 processes each (``--nnodes 2`` on 127.0.0.1) form one world of 4; the group
scenarios run over it, and killing the launcher of the node without the controller fails the pending call
within seconds, naming that node and its ranks. The Ray half is in ``test_ray_multinode.py``; the demo's
PPO job on two nodes under both launchers is in ``test_multinode_jobs.py``.
"""

import ipaddress
import json
import os
import threading
import time

import psutil
import pytest

import group_checks
from conftest import TESTS, run_torchrun, start_torchrun_nodes


class Launchers:
    """Started torchrun launchers, their output read as it comes, every one stopped at the end."""

    def __init__(self, procs) -> None:
        self.procs = procs
        self.lines: list[list[str]] = [[] for _ in procs]
        self.errors: list[list[str]] = [[] for _ in procs]
        for i, proc in enumerate(procs):
            threading.Thread(target=self._read, args=(proc.stdout, self.lines[i]), daemon=True).start()
            threading.Thread(target=self._read, args=(proc.stderr, self.errors[i]), daemon=True).start()

    @staticmethod
    def _read(stream, sink) -> None:
        for line in stream:
            sink.append(line)

    def wait_for_line(self, text: str, timeout: float) -> int:
        """Index of the launcher that printed ``text``."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for i, lines in enumerate(self.lines):
                if any(text in line for line in lines):
                    return i
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.1)
        raise AssertionError(f"no launcher printed {text!r} within {timeout} s:\n{self.output()}")

    def wait(self, timeout: float) -> list[int]:
        deadline = time.time() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.time())))
            except Exception:  # noqa: BLE001 - reported with the output below
                raise AssertionError(f"a launcher is still running after {timeout} s:\n{self.output()}") from None
        return codes

    def kill_node(self, index: int) -> None:
        """SIGKILL the launcher and every process under it (its workers lead sessions of their own): the node is gone."""
        launcher = psutil.Process(self.procs[index].pid)
        for proc in [*launcher.children(recursive=True), launcher]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        for index, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.kill_node(index)
                proc.wait()

    def output(self) -> str:
        return "\n".join(f"--- launcher {i} stdout:\n{''.join(o)[-3000:]}\n--- stderr:\n{''.join(e)[-4000:]}"
                         for i, (o, e) in enumerate(zip(self.lines, self.errors)))


@pytest.fixture
def launchers():
    started: list[Launchers] = []

    def start(command, nnodes=2, nproc_per_node=2, **kwargs) -> Launchers:
        started.append(Launchers(start_torchrun_nodes(command, nnodes, nproc_per_node, **kwargs)))
        return started[-1]

    yield start
    for group in started:
        group.stop()


def test_two_torchrun_launchers_form_one_world(tmp_path, launchers):
    out = tmp_path / "where.json"
    nodes = launchers([str(TESTS / "group_scenarios.py"), "where", str(out)])
    assert nodes.wait(180) == [0, 0], nodes.output()
    result = json.loads(out.read_text())
    where = result["where"]
    assert [w["rank"] for w in where] == [0, 1, 2, 3]
    assert [w["node_rank"] for w in where] == ["0", "0", "1", "1"]  # two ranks per launcher, node-major
    assert {w["world_sum"] for w in where} == {10.0}  # 1+2+3+4: one torch.distributed world over both nodes
    assert len({w["pid"] for w in where}) == 4
    assert all(ipaddress.ip_address(host).is_loopback for w in where for host in w["remote_hosts"]), where
    assert result["rank_nodes"] == ["0 (127.0.0.1)"] * 2 + ["1 (127.0.0.1)"] * 2
    assert result["echo"] == [[r, 7, "t"] for r in range(4)]


def test_every_dispatch_mode_over_two_torchrun_launchers(tmp_path, launchers):
    out = tmp_path / "modes.json"
    nodes = launchers([str(TESTS / "group_scenarios.py"), "modes", str(out)])
    assert nodes.wait(240) == [0, 0], nodes.output()
    group_checks.check_modes(json.loads(out.read_text()))


def test_a_lost_torchrun_node_fails_the_pending_call_naming_the_node(tmp_path, launchers):
    out = tmp_path / "lost.json"
    # The surviving launcher must not tear its node down before the controller has reported (as in the faults test).
    nodes = launchers([str(TESTS / "group_scenarios.py"), "lost_node", str(out)], monitor_interval=5)
    controller = nodes.wait_for_line("calls pending, kill the node now", timeout=180)
    other = 1 - controller
    killed_at = time.time()
    nodes.kill_node(other)
    codes = nodes.wait(90)  # nothing hangs: both launchers end
    assert time.time() - killed_at < 60, nodes.output()
    result = json.loads(out.read_text())
    error = result["error"]
    assert isinstance(error, dict), (error, nodes.output())
    assert error["type"] == "WorkerDiedError" and error["seconds"] < 10, error
    # Node 1 holds ranks 2 and 3 (the controller, rank 0, is on node 0); the error names the node and its ranks.
    assert "during 'sleep'" in error["text"] and "on node 1 (127.0.0.1) (which runs ranks [2, 3])" in error["text"], error
    assert codes[other] != 0 and codes[controller] != 0  # the job failed, on both nodes


def test_a_multi_node_torchrun_job_without_a_rendezvous_or_with_the_wrong_world_is_refused_before_it_starts(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "controller.cli", "train", "--config", "examples/ppo_tiny.yaml",
                           "trainer.nnodes=2", f"trainer.run_dir={tmp_path}"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(ROOT))
    assert proc.returncode == 2
    assert "trainer.nnodes=2 with trainer.launcher=torchrun: set trainer.rdzv_endpoint=host:port" in proc.stderr
    # A torchrun world of 2 for a config of 2 nodes x 2: the job stops before any group forms.
    script = tmp_path / "train.py"
    script.write_text("from controller.config import load_config\n"
                      "from controller.jobs.train_job import run_training\n"
                      "try:\n"
                      f"    run_training(load_config({str(ROOT / 'examples/ppo_tiny.yaml')!r}, "
                      f"['trainer.nnodes=2', 'trainer.nproc=2', 'trainer.run_dir={tmp_path}']))\n"
                      "except Exception as exc:\n"
                      "    print('REFUSED:', exc)\n")
    proc = run_torchrun(script, [], 2)
    assert "REFUSED: torchrun started WORLD_SIZE=2 processes, but trainer.nnodes x nproc = 2 x 2" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-3000:])
