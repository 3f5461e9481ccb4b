"""Run a benchmark script as a CPU torchrun job and read back the JSON row its rank 0 writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_torchrun_job(script: str, nproc: int, args: list[str], label: str, env: dict[str, str] | None = None) -> dict:
    """``torchrun --standalone --nproc-per-node nproc script --inner OUT *args``; returns OUT's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   script, "--inner", str(out), *args]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        proc = subprocess.run(command, capture_output=True, text=True, env=full_env)
        if not out.exists():
            raise RuntimeError(f"{label} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        row = json.loads(out.read_text())
    print(json.dumps(row), file=sys.stderr)
    return row
