"""The README's example runs as written, and the CLI's demo job trains for real."""

import os
import re
import subprocess
import sys

from conftest import ROOT, run_torchrun


def readme_python_blocks():
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_worker_example_is_the_example_file():
    assert (ROOT / "examples" / "custom_worker.py").read_text() in readme_python_blocks()


def test_readme_worker_example_runs_on_ray(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_python_blocks()[0])
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rewards: [1.0, 0.3333333432674408, 0.3333333432674408]" in proc.stdout
    assert "rows scored, summed over the group: [4, 4]" in proc.stdout


def test_readme_worker_example_runs_under_torchrun():
    proc = run_torchrun(ROOT / "examples" / "custom_worker.py", [], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rewards: [1.0, 0.3333333432674408, 0.3333333432674408]" in proc.stdout


def test_cli_demo_trains_under_torchrun():
    """The main job: worker groups, then megatron PPO at TP2xPP2 with resharding, on 4 processes."""
    proc = run_torchrun(ROOT / "controller" / "cli.py", ["demo", "--workers", "4", "--steps", "40"], 4, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    final = re.search(r"replicas identical to (\S+); max \|w - w_true\| = (\S+);", proc.stdout)
    assert final, proc.stdout
    assert float(final.group(1)) == 0.0 and float(final.group(2)) < 0.05
    assert "backend=torchrun: 4 worker processes" in proc.stdout
    assert "megatron actor at TP2xPP2xDP1" in proc.stdout
    gap = re.search(r"log-prob gap (\S+) -> (\S+)", proc.stdout)
    assert gap and float(gap.group(2)) > float(gap.group(1)) + 0.5, proc.stdout[-3000:]


def test_console_command_demo_on_ray():
    command = os.path.join(os.path.dirname(sys.executable), "hybridflow")
    proc = subprocess.run(
        [command, "demo", "--backend", "ray", "--workers", "2", "--steps", "40"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "backend=ray: 2 worker processes" in proc.stdout
    assert "replicas identical to 0.0e+00" in proc.stdout
