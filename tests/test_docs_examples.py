"""The docs' runnable examples run as written (a ```python block after a `<!-- runnable -->` line, in the README
or on any page under docs/): the researcher's API snippet (the README's, which the docs page includes), the
worker example on both launchers, and any other block marked so. The README stays a short entrance."""

import os
import re
import subprocess
import sys

from conftest import ROOT, run_torchrun


def runnable_blocks() -> dict[str, str]:
    """Each runnable block of the docs, by "page:index"."""
    blocks = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, block in enumerate(re.findall(r"<!-- runnable -->\n```python\n(.*?)```", page.read_text(), flags=re.S)):
            blocks[f"{page.relative_to(ROOT)}:{i}"] = block
    return blocks


def runnable_python_blocks():
    return list(runnable_blocks().values())


def test_the_readme_is_an_entrance_and_every_runnable_block_runs(tmp_path):
    """README: at most 250 lines. A runnable block that no test below runs with its own checks runs here."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    example = (ROOT / "examples" / "custom_worker.py").read_text()
    blocks = runnable_blocks()
    assert len(blocks) >= 2
    for name, block in blocks.items():
        if block == example or "def dynamic_kl_loss(" in block:
            continue  # run below, with their own checks
        script = tmp_path / "block.py"
        script.write_text(block)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"


def test_docs_worker_example_is_the_example_file():
    assert (ROOT / "examples" / "custom_worker.py").read_text() in runnable_python_blocks()


def test_docs_worker_example_runs_on_ray(tmp_path):
    """As written, where Ray's temp dir and RAY_ADDRESS name a cluster that is gone (as one left behind here did):
    the example still gets a private cluster of its own and runs."""
    from pathlib import Path

    from ray._private.utils import get_ray_address_file

    script = tmp_path / "example.py"
    example = (ROOT / "examples" / "custom_worker.py").read_text()
    script.write_text(next(block for block in runnable_python_blocks() if block == example))
    address_file = Path(get_ray_address_file(None))
    saved = address_file.read_text() if address_file.exists() else None
    address_file.parent.mkdir(parents=True, exist_ok=True)
    address_file.write_text("127.0.0.77:6379")  # nothing listens there
    try:
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "127.0.0.77:6379"},
        )
    finally:
        if saved is None:
            address_file.unlink(missing_ok=True)
        else:
            address_file.write_text(saved)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rewards: [1.0, 0.3333333432674408, 0.3333333432674408]" in proc.stdout
    assert "rows scored, summed over the group: [4, 4]" in proc.stdout


def test_docs_worker_example_runs_under_torchrun():
    proc = run_torchrun(ROOT / "examples" / "custom_worker.py", [], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rewards: [1.0, 0.3333333432674408, 0.3333333432674408]" in proc.stdout


def test_docs_researcher_snippet_runs_as_written(tmp_path):
    """The README's researcher block (the first design document's PPO with a dynamic KL coefficient),
    run unchanged in an empty directory: Ray, one process, every role colocated, device_map="auto", a DeBERTa
    reward model through transformers, the critic from the policy's LM, generation in vLLM."""
    block = next(b for b in runnable_python_blocks() if "def dynamic_kl_loss(" in b)
    assert "from hybridflow import" in block and "from hybridflow.trainer import RLTrainer" in block
    script = tmp_path / "researcher.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    steps = re.findall(r"Step (\d): KL=(\S+), beta=(\S+)", proc.stdout)
    assert [s[0] for s in steps] == ["0", "1", "2"], proc.stdout[-3000:]
    # linear_schedule(0.2, 0.02, step, 1000) at steps 0-2, recovered from the function's loss
    assert [s[2] for s in steps] == ["0.200", "0.200", "0.200"]
    assert all(abs(float(s[1])) < 1.0 for s in steps)
    assert len(re.findall(r"\[hybridflow\] rollout: generated 16 sequences", proc.stdout)) == 3
    assert len(re.findall(r"\[hybridflow\] update: pg_loss=\S+, vf_loss=\S+, kl_div=\S+, beta=0.200", proc.stdout)) == 3
