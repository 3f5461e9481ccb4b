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


def run_program(program: str, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``program`` (given its output folder as argv[1]); also how long its end took: from the time it wrote
    to ``exit_called`` just before calling exit_process, to the end of the process."""
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(program), str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=120)
    ended = time.time()
    return proc, ended - float((tmp_path / "exit_called").read_text())


def test_a_thread_pool_still_referenced_at_exit_does_not_hold_the_process(tmp_path):
    """An idle pool worker waits for work until concurrent.futures' threading-atexit hook tells it to leave: the
    hook must run before the join (it held a serving torchrun rank of `make demo` for minutes)."""
    proc, ending = run_program("""
        import concurrent.futures, sys, time
        from pathlib import Path
        from controller.runtime.process_exit import exit_process

        pool = concurrent.futures.ThreadPoolExecutor(1)
        pool.submit(lambda: 1).result()
        Path(sys.argv[1], "exit_called").write_text(repr(time.time()))
        exit_process(0)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ending < 10, ending
    assert "still running" not in proc.stderr


def test_a_thread_that_never_ends_costs_the_bound_and_is_named(tmp_path):
    """A library's thread that is not a daemon and never returns (or a pool's task that never returns, which the
    pool's own exit hook joins) keeps the process HYBRIDFLOW_EXIT_JOIN_S seconds, then the process ends with its
    own code, its atexit handlers run, and the thread is named with its stack."""
    proc, ending = run_program("""
        import atexit, concurrent.futures, sys, threading, time
        from pathlib import Path
        from controller.runtime.process_exit import exit_process

        out = Path(sys.argv[1])
        atexit.register(lambda: (out / "atexit").write_text("ran"))

        def forever():
            time.sleep(3600)

        threading.Thread(target=forever, name="stuck-library-thread").start()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="busy-pool")
        pool.submit(forever)
        (out / "exit_called").write_text(repr(time.time()))
        exit_process(4)
    """, tmp_path, HYBRIDFLOW_EXIT_JOIN_S="1")
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert 1 <= ending < 10, ending
    assert (tmp_path / "atexit").read_text() == "ran"
    for name in ("stuck-library-thread", "busy-pool_0"):
        assert f"thread {name!r} (not a daemon) still running after 1 s" in proc.stderr, proc.stderr[-3000:]
    assert "in forever" in proc.stderr  # the stack says where it is


def test_a_bad_join_bound_is_refused_naming_the_value(monkeypatch):
    from controller.runtime.process_exit import join_bound_s

    monkeypatch.setenv("HYBRIDFLOW_EXIT_JOIN_S", "soon")
    with pytest.raises(ValueError, match=r"HYBRIDFLOW_EXIT_JOIN_S='soon' must be a number of seconds >= 0"):
        join_bound_s()
    monkeypatch.setenv("HYBRIDFLOW_EXIT_JOIN_S", "2.5")
    assert join_bound_s() == 2.5
