"""Escape programs for the sandbox, and a driver that runs them all at every level as whoever runs it.

    python3 -I sandbox_escapes.py PACKAGE_DIR

PACKAGE_DIR holds a ``workers`` package whose ``sandbox`` is the project's (the driver needs nothing else of
it, so a system interpreter without the project's dependencies runs it, as an unprivileged user would). It
prints one JSON object: {"uid", "levels": {level: {escape: outcome}}, "unavailable": {level: why}}, an
outcome being the result's status, stdout, the end of stderr, its duration, and the pids of the program's
processes still running two seconds after it ended.

``test_sandbox.py`` runs it as uid 65534 under a root parent (the path a real deployment takes) and uses
the same programs in its own tests.
"""

from __future__ import annotations

import json
import os
import sys
import time

MARK = ["-I", "-B", "main.py"]  # the tail of every sandboxed interpreter's command line (and its forks')
MiB = 2**20

LOOP = "while True:\n    pass\n"
# Keeps forking whatever fails; each process reports the first fork the limit refused (EAGAIN).
FORK_BOMB = ("import os\nrefused = False\nwhile True:\n    try:\n        os.fork()\n    except OSError as exc:\n"
             "        if not refused:\n            print('EAGAIN' if exc.errno == 11 else exc, flush=True)\n"
             "            refused = True\n")
ALLOCATE_10_GB = "data = bytearray(10 * 2**30)\nprint('allocated')"
WRITE_1_GB = ("with open('big.bin', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2**20)\n"
              "print('wrote 1 GB')")
PRINT_100_MB = "print('x' * 100_000_000)"
# Six children of 300 MB each (1.8 GB in all), every page touched; each prints 'held' once it holds them.
SIX_CHILDREN = """
import os, time
children = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        data = bytearray(300 * 2**20)
        for i in range(0, len(data), 4096):
            data[i] = 1
        print('held', flush=True)
        time.sleep(1)
        os._exit(0)
    children.append(pid)
print('exits', [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children])
"""
# A child leaves the program's session (setsid), forks a grandchild that sleeps, and exits; the program ends.
SETSID_CHILD = """
import os, time
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork() == 0:
        print('grandchild', flush=True)
        time.sleep(60)
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(0.3)
print('done')
"""


def sandbox_processes(uid: int) -> list[int]:
    """Live (not zombie) processes of ``uid`` that are sandboxed programs (their forks too)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")[:-1]
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        state, real_uid = status["State"].split()[0], int(status["Uid"].split()[0])
        if state != "Z" and real_uid == uid and [c.decode(errors="replace") for c in cmdline[-3:]] == MARK:
            found.append(int(entry))
    return found


def escapes(limits_type):
    """name -> (program, limits)."""
    return {
        "loop": (LOOP, limits_type(timeout=1.0)),
        "fork_bomb": (FORK_BOMB, limits_type(timeout=2.0, processes=32)),
        "allocate_10_gb": (ALLOCATE_10_GB, limits_type()),
        "write_1_gb": (WRITE_1_GB, limits_type()),
        "print_100_mb": (PRINT_100_MB, limits_type()),
        "six_children": (SIX_CHILDREN, limits_type(timeout=20.0, processes=4)),
        "setsid_child": (SETSID_CHILD, limits_type(timeout=10.0)),
    }


def main(package_dir: str) -> None:
    sys.path.insert(0, package_dir)
    from workers.sandbox import cgroup
    from workers.sandbox.isolation import LEVELS, available_levels, unavailable_reasons, level_facts
    from workers.sandbox.limits import SandboxLimits
    from workers.sandbox.runner import run

    out = {"uid": os.getuid(), "cgroup": cgroup.available(), "levels": {}, "unavailable": unavailable_reasons()}
    for level in available_levels():
        uid = level_facts(level).uid
        outcomes = out["levels"][level] = {}
        for name, (code, limits) in escapes(SandboxLimits).items():
            result = run(code, limits=limits, isolation=level)
            deadline = time.monotonic() + 2.0
            while (left := sandbox_processes(uid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            outcomes[name] = {"status": result.status, "stdout": result.stdout[:2000], "stderr": result.stderr[-500:],
                              "duration_s": result.duration_s, "left": left,
                              "memory_bound": cgroup.memory_bound(limits), "limits": limits.__dict__}
    assert set(out["levels"]) | set(out["unavailable"]) == set(LEVELS)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
