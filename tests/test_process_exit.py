"""exit_process: a prompt end that still does what a normal exit does for the process's outputs."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

PROGRAM = textwrap.dedent("""
    import atexit, sys, threading, time, weakref
    from pathlib import Path
    import torch
    from controller.runtime.process_exit import exit_process

    out = Path(sys.argv[1])
    library = torch.library.Library("process_exit_test", "DEF")  # unregistered at exit only without the fast path
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: 2 * x, "CompositeExplicitAutograd")
    assert torch.ops.process_exit_test.twice(torch.ones(1)).item() == 2.0

    class Holder:
        pass

    holder = Holder()
    weakref.finalize(holder, lambda: (out / "finalizer").write_text("ran"))  # an ordinary exit-time finalizer
    atexit.register(lambda: (out / "atexit").write_text("ran"))

    def late_writer():  # not a daemon: a normal exit waits for it
        time.sleep(0.5)
        (out / "thread").write_text("ran")

    threading.Thread(target=late_writer).start()
    print("buffered line", end="")  # no newline: still in stdout's buffer
    exit_process(3)
""")


@pytest.mark.parametrize("fast", ["1", "0"])
def test_exit_process_keeps_the_exit_code_handlers_threads_and_buffered_output(tmp_path, fast):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYBRIDFLOW_FAST_EXIT": fast}
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stdout == "buffered line"
    for name in ("atexit", "finalizer", "thread"):
        assert (tmp_path / name).read_text() == "ran", name


def test_only_torchs_operator_unregistering_is_skipped():
    import weakref

    import torch

    from controller.runtime.process_exit import _skip_operator_unregistering

    class Holder:
        pass

    holder = Holder()
    ordinary = weakref.finalize(holder, print)
    library = torch.library.Library("process_exit_probe", "DEF")
    library.define("probe(Tensor x) -> Tensor")
    deregister = [f for f in weakref.finalize._registry if f.peek() and f.peek()[0] is library]
    assert deregister and all(f.atexit for f in deregister)
    _skip_operator_unregistering()
    assert ordinary.atexit and not any(f.atexit for f in deregister)
    for finalizer in deregister:  # leave this process as it was: unregister the probe now
        finalizer.atexit = True
        finalizer()
    ordinary.detach()
