"""The README's worker example runs as written, on both launchers."""

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
    example = (ROOT / "examples" / "custom_worker.py").read_text()
    script.write_text(next(block for block in readme_python_blocks() if block == example))
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
