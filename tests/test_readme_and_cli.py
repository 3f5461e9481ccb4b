"""The README's examples run as written: the researcher's API snippet, and the worker example on both launchers."""

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


def test_readme_researcher_snippet_runs_as_written(tmp_path):
    """The block under "The researcher's API", run unchanged in an empty directory (Ray, 2 worker processes)."""
    block = next(b for b in readme_python_blocks() if "value_model_from_policy(" in b)
    assert "from hybridflow import" in block  # the README teaches the one import
    script = tmp_path / "researcher.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    reward, kl_coef = map(float, re.search(r"reward (\S+), KL coefficient (\S+)", proc.stdout).groups())
    assert 0.0 <= reward <= 1.0
    assert kl_coef != 0.05  # the adaptive controller moved off its initial coefficient over the 3 steps
    assert (tmp_path / "runs" / "api" / "critic-init" / "config.json").is_file()
