"""SandboxResult and its statuses: what happened to one sandboxed program, as a name.

========================  ==============================================================
status                    meaning
========================  ==============================================================
``ok``                    exited with code 0 within every limit
``error``                 exited with a non-zero code (an uncaught exception, sys.exit(1))
``timeout``               passed the wall-clock timeout (killed) or its CPU time (SIGXCPU)
``memory``                an allocation failed at the address-space limit (MemoryError), or
                          the kernel killed its processes at the bound of them all (a cgroup)
``processes``             a fork failed at the process limit (EAGAIN) and the program ended
                          on it
``output``                printed more than the output limit (killed, text truncated)
``file_size``             a write failed at the file-size limit (EFBIG, SIGXFSZ) or the
                          sandbox's tmpfs was full (ENOSPC)
``killed``                ended by a signal it was not sent for a limit (SIGSEGV, SIGKILL)
``sandbox_error``         the sandbox itself could not start (the program never ran)
========================  ==============================================================

"memory", "processes" and "file_size" are read from the program's exit:
Python turns those failures into exceptions, so the last line of stderr names
them (``MemoryError``, ``BlockingIOError: [Errno 11]``, ``OSError: [Errno 27]
File too large``). A program that catches them and exits otherwise gets the
status of that exit. A program whose processes the kernel killed at its
cgroup's memory bound is "memory" however it exited, and stderr ends with a
line saying so (``runner``).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

__all__ = ["OK", "ERROR", "TIMEOUT", "MEMORY", "PROCESSES", "OUTPUT", "FILE_SIZE", "KILLED", "SANDBOX_ERROR", "STATUSES",
           "SandboxResult", "classify"]

OK = "ok"
ERROR = "error"
TIMEOUT = "timeout"
MEMORY = "memory"
PROCESSES = "processes"
OUTPUT = "output"
FILE_SIZE = "file_size"
KILLED = "killed"
SANDBOX_ERROR = "sandbox_error"
STATUSES = (OK, ERROR, TIMEOUT, MEMORY, PROCESSES, OUTPUT, FILE_SIZE, KILLED, SANDBOX_ERROR)

# The last line of a traceback for each limit Python reports as an exception.
_MEMORY_LINE = re.compile(r"^MemoryError\b")
_PROCESSES_LINE = re.compile(r"^(?:BlockingIOError|OSError): \[Errno 11\] ")  # EAGAIN: a fork refused
_FILE_SIZE_LINE = re.compile(r"^(?:\w+\.)*\w*Error: \[Errno (?:27|28)\] ")  # EFBIG, ENOSPC


@dataclass(frozen=True)
class SandboxResult:
    """What one program did: its status, output, exit and how long it took.

    ``returncode`` is the exit code, ``-N`` for a death by signal N (as
    subprocess reports it), None when the program never ran.
    ``truncated`` says the output limit cut stdout / stderr. ``isolation``
    is the level that ran it ("bwrap", "unshare" or "limits-only").
    ``peak_memory_bytes``: the most its processes held at once, where the
    program ran in a cgroup leaf (``cgroup.py``), else None.
    """

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    duration_s: float
    isolation: str
    truncated: bool = False
    # the most memory the program's processes held at once, where a cgroup leaf counted it (None: no leaf)
    peak_memory_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def signal(self) -> int | None:
        """The signal that ended the program, if one did."""
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None

    def summary(self) -> str:
        """One line: the status and what explains it (the exit, the signal or stderr's last line)."""
        if self.status == OK:
            return "ok"
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"{self.status} ({name})"
        last = _last_line(self.stderr)
        code = f"exit code {self.returncode}" if self.returncode is not None else "did not run"
        return f"{self.status} ({code}{': ' + last if last else ''})"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def classify(returncode: int | None, stderr: str, *, timed_out: bool, output_exceeded: bool) -> str:
    """The status of a finished program from how it ended (``returncode`` as subprocess gives it)."""
    if output_exceeded:
        return OUTPUT
    if timed_out:
        return TIMEOUT
    if returncode is None:
        return SANDBOX_ERROR
    if returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU:
            return TIMEOUT
        if sig == signal.SIGXFSZ:
            return FILE_SIZE
        return KILLED
    if returncode == 0:
        return OK
    last = _last_line(stderr)
    if _MEMORY_LINE.match(last):
        return MEMORY
    if _PROCESSES_LINE.match(last):
        return PROCESSES
    if _FILE_SIZE_LINE.match(last):
        return FILE_SIZE
    return ERROR
