"""The console: third-party INFO lines and known-harmless warnings are filtered, real ones are not.

Each case runs in a fresh interpreter: the choice lives in process-wide
logging and warnings state and in the environment. The CLI runs of
test_train_cli.py check the same on real runs (the demo's layout included):
no third-party WARNING/INFO line reaches stdout.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

PROGRAM = r"""
import sys, warnings
from workers.console import configure_console
configure_console(verbose=sys.argv[1] == "1")
from vllm.logger import init_logger
from vllm.logger import _configure_vllm_root_logger
_configure_vllm_root_logger()  # what an engine start does
log = init_logger("vllm.engine.arg_utils")
log.info("an engine start-up detail")
log.warning("The global random seed is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, ...")
log.warning("KV cache is too small for this request")
log.error("the engine died")
warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
warnings.warn("a real deprecation in user code", UserWarning)
import logging
logging.getLogger("megatron.core.optimizer").info("megatron start-up detail")
logging.getLogger("megatron.core.optimizer").warning("megatron real warning")
"""


def run(verbose: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HYBRIDFLOW_VERBOSE", "TRANSFORMERS_"))}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", PROGRAM, "1" if verbose else "0"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(ROOT))


def test_quiet_by_default_keeps_real_warnings_and_errors():
    proc = run(verbose=False)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "an engine start-up detail" not in out  # vLLM INFO
    assert "The global random seed" not in out  # a listed harmless vLLM warning
    assert "Transformer Engine and Apex are not installed" not in out  # a listed harmless Python warning
    assert "megatron start-up detail" not in out  # third-party INFO
    # Everything not on the lists still shows.
    assert "KV cache is too small for this request" in proc.stdout
    assert "the engine died" in proc.stdout
    assert "a real deprecation in user code" in proc.stderr
    assert "megatron real warning" in proc.stderr


def test_verbose_shows_everything():
    proc = run(verbose=True)
    assert proc.returncode == 0, proc.stderr
    for line in ("an engine start-up detail", "The global random seed", "KV cache is too small", "the engine died"):
        assert line in proc.stdout, line
    assert "Transformer Engine and Apex are not installed" in proc.stderr
