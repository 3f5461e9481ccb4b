"""The first process of a limits-only program where no cgroup holds it: it outlives the program and kills
every process the program left, whatever sessions they made.

    python -I -S reaper.py ARGV...

A process that calls ``setsid()`` leaves the program's process group, and once its parent exits the
kernel hands it to the nearest ancestor that is a child subreaper, not to init, when there is one. This
process is that subreaper (``PR_SET_CHILD_SUBREAPER``): it starts ARGV, waits for it, then SIGKILLs every
descendant it has until none is left, reaps them, and exits as the program did (its code, or the same
signal). SIGTERM (the supervisor at a limit) kills the program and everything it made at once.

Run by path with the system interpreter in isolated mode: it imports nothing of the trainer's.
"""

import ctypes
import os
import resource
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def descendants() -> set[int]:
    """Every process below this one (children of children...), read from /proc."""
    found: set[int] = set()
    frontier = [os.getpid()]
    while frontier:
        pid = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    children = {int(c) for c in f.read().split()}
            except OSError:
                continue
            for child in children - found:
                found.add(child)
                frontier.append(child)
    return found


def kill_all() -> None:
    deadline = time.monotonic() + 5.0
    while True:
        left = descendants()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:  # reap what died (orphans are this process's children now)
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def main(argv: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"hybridflow-sandbox: reaper: prctl failed (errno {ctypes.get_errno()})", file=sys.stderr)
        os._exit(125)

    def stop(signum, frame):
        kill_all()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # exiting by the program's signal dumps nothing
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    kill_all()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main(sys.argv[1:])
