"""verl's own virtual environment for tools/bench_controller_verl.py: created on first use, the benchmark run in it.

    python tools/verl_venv.py                                # create build/verl-venv if needed, run 4 workers
    python tools/verl_venv.py --workers 2 4 --serialization numpy --json build/bench_controller_verl.json
    python -c "from tools.verl_venv import ensure_verl_venv; print(ensure_verl_venv())"

verl is never a dependency of the project and nothing here imports it: this
module runs in the project's venv, creates ``build/verl-venv`` (``VERL_PACKAGES``:
torch 2.13.0, verl[verl-core] 0.9.1 and ray 2.60.0, about 70 s here; the log
goes next to the venv) when it does not already hold those versions, and runs
tools/bench_controller_verl.py in it as a child process (without the project's
PYTHONPATH), reading its rows back from the JSON file the script writes.

torch==2.13.0 resolves to the CPU wheel on this machine (pip's find-links
holds torch-2.13.0+cpu). Elsewhere PyPI's torch 2.13.0 is the CUDA build;
pass ``extra_pip_args=("--extra-index-url", "https://download.pytorch.org/whl/cpu")``
(``--extra-index-url`` on the command line) for the CPU one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERL_VERSION = "0.9.1"
RAY_VERSION = "2.60.0"
TORCH_VERSION = "2.13.0"
VERL_PACKAGES = (f"torch=={TORCH_VERSION}", f"verl[verl-core]=={VERL_VERSION}", f"ray=={RAY_VERSION}")
VERL_SCRIPT = ROOT / "tools" / "bench_controller_verl.py"
DEFAULT_VENV = "build/verl-venv"
SERIALIZATIONS = ("torch", "numpy")

# Run in the venv's python: exits 0 when the installed versions are the pinned ones (no verl import: fast).
_CHECK = (
    "import sys\n"
    "from importlib.metadata import version\n"
    "want = {want!r}\n"
    "have = {{name: version(name) for name in want}}\n"
    "sys.exit(any(have[name].split('+')[0] != want[name] for name in want))\n"
)


def _venv_path(path: str | Path) -> Path:
    path = Path(path)
    return path if path.is_absolute() else ROOT / path


def _log(message: str) -> None:
    print(f"[verl_venv] {message}", file=sys.stderr, flush=True)


def _has_pins(python: Path) -> bool:
    want = {"verl": VERL_VERSION, "ray": RAY_VERSION, "torch": TORCH_VERSION}
    check = [str(python), "-c", _CHECK.format(want=want)]
    return python.is_file() and subprocess.run(check, capture_output=True).returncode == 0


def ensure_verl_venv(path: str | Path = DEFAULT_VENV, extra_pip_args: Sequence[str] = ()) -> Path:
    """The python of verl's venv at ``path`` (relative to the repository root), created or completed when needed.

    Idempotent: a venv that already holds verl VERL_VERSION, ray RAY_VERSION and torch TORCH_VERSION is left
    alone. Otherwise the venv is created (when missing) from the base interpreter of this one and
    ``VERL_PACKAGES`` are pip-installed into it, with ``extra_pip_args``; pip's output goes to
    ``<path>-install.log``.
    """
    venv = _venv_path(path)
    python = venv / "bin" / "python"
    if _has_pins(python):
        _log(f"{venv} has verl {VERL_VERSION}, ray {RAY_VERSION}, torch {TORCH_VERSION}")
        return python
    log = venv.with_name(venv.name + "-install.log")
    venv.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        if not python.is_file():
            base = getattr(sys, "_base_executable", sys.executable)
            _log(f"creating {venv} with {base}")
            subprocess.run([base, "-m", "venv", str(venv)], check=True, stdout=out, stderr=subprocess.STDOUT)
        _log(f"installing {' '.join(VERL_PACKAGES)} into {venv} (about 70 s; log {log})")
        command = [str(python), "-m", "pip", "install", "-q", *VERL_PACKAGES, *extra_pip_args]
        proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode or not _has_pins(python):
        raise RuntimeError(f"installing {' '.join(VERL_PACKAGES)} into {venv} failed; see {log}")
    _log(f"{venv} ready in {time.perf_counter() - started:.0f} s")
    return python


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    return env


def run_verl_bench(workers: int | Sequence[int] = 4, repeats: int = 15, rtt_calls: int = 200,
                   serialization: str | Sequence[str] = SERIALIZATIONS, venv: str | Path = DEFAULT_VENV,
                   timeout: float | None = 900, json_path: str | Path | None = None,
                   extra_pip_args: Sequence[str] = ()) -> list[dict]:
    """Run tools/bench_controller_verl.py in verl's venv (created if needed) and return its rows.

    ``serialization`` is "torch", "numpy" or both (verl's two DataProto picklings, see the script). The
    script's table goes to this process's stdout; ``json_path`` also keeps its whole JSON (rows and the
    cluster start, import time and versions); ``extra_pip_args`` go to ``ensure_verl_venv``.
    """
    python = ensure_verl_venv(venv, extra_pip_args)
    workers = [workers] if isinstance(workers, int) else list(workers)
    serialization = [serialization] if isinstance(serialization, str) else list(serialization)
    unknown = sorted(set(serialization) - set(SERIALIZATIONS))
    if unknown:
        raise ValueError(f"serialization {unknown} is not one of {SERIALIZATIONS}")
    with tempfile.TemporaryDirectory(prefix="bench_controller_verl_") as tmp:
        out = Path(json_path) if json_path else Path(tmp) / "rows.json"
        command = [str(python), str(VERL_SCRIPT), "--workers", *map(str, workers), "--repeats", str(repeats),
                   "--rtt-calls", str(rtt_calls), "--serialization", *serialization, "--json", str(out)]
        try:
            proc = subprocess.run(command, cwd=ROOT, env=_child_env(), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{VERL_SCRIPT.name} ran past {timeout} s") from None
        if proc.returncode or not out.is_file():
            raise RuntimeError(f"{VERL_SCRIPT.name} exited {proc.returncode} without writing {out}")
        return json.loads(out.read_text())["rows"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", default=DEFAULT_VENV)
    parser.add_argument("--workers", nargs="+", type=int, default=[4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rtt-calls", type=int, default=200)
    parser.add_argument("--serialization", nargs="+", default=list(SERIALIZATIONS), choices=SERIALIZATIONS)
    parser.add_argument("--json", metavar="PATH", help="also keep the script's JSON")
    parser.add_argument("--extra-index-url", metavar="URL", help="for pip, when the venv is created")
    args = parser.parse_args(argv)
    extra = ("--extra-index-url", args.extra_index_url) if args.extra_index_url else ()
    run_verl_bench(args.workers, args.repeats, args.rtt_calls, args.serialization, args.venv, json_path=args.json,
                   extra_pip_args=extra)


if __name__ == "__main__":
    main()
