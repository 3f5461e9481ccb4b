"""Run a benchmark script as a CPU torchrun job and read back the JSON row its rank 0 writes; the GPU checks'
command line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def device_check_args(doc: str, inner, options: dict[str, tuple[type, object]],
                      hidden: tuple[str, ...]) -> argparse.Namespace | None:
    """The command line of a GPU check (``tools/check_*_gpu.py``): ``--allow-cpu``, ``--json``, the check's own
    ``options`` (name -> (type, default)) and the ``hidden`` ones its torchrun job takes. Under torchrun
    (``--inner OUT``): runs ``inner(args)`` and writes its JSON to OUT, returning None. Else refuses to run
    without a GPU unless ``--allow-cpu`` (a dry run on the CPU) and returns the arguments."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU when no GPU is visible")
    for name, (kind, default) in options.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)
    parser.add_argument("--json")
    for name in ("inner", *hidden):
        parser.add_argument(f"--{name.replace('_', '-')}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        Path(args.inner).write_text(json.dumps(inner(args)))
        return None
    from hybridengine.device import accelerator_available

    if not accelerator_available() and not args.allow_cpu:
        raise SystemExit("no GPU visible (give --allow-cpu for a dry run on the CPU)")
    return args


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
