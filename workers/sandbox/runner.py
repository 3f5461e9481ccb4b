"""run: one untrusted program in a sandbox, to a SandboxResult; it never raises for what the program did.

::

    result = run("print(sum(range(10)))")
    result.status, result.stdout              # ("ok", "45\\n")
    run("import sys; print(sys.stdin.read()[::-1])", stdin="abc").stdout   # "cba\\n"
    run("print(open('data.txt').read())", files={"data.txt": "hello"}).stdout
    run("while True: pass", timeout=1).status  # "timeout"

What happens, in order:

1. The arguments are checked (ValueError naming the value and what is valid).
2. A temporary directory is made (``hybridflow-sandbox-*`` under the temp
   dir) with ``work/`` (the program's cwd and HOME, holding ``files`` and the
   program as ``main.py``) and ``tmp/`` (its TMPDIR at the levels without a
   /tmp of their own). Under a root parent both belong to uid 65534.
3. The level's command starts (``isolation.launch``) in a new session, with
   only ``sandbox_env`` as its environment, inside a cgroup leaf of its own
   where this machine gives one (``cgroup``: the whole program's memory and
   process count), else, at limits-only, under a reaper (``reaper.py``).
4. The parent writes stdin, reads stdout and stderr up to ``limits.output``
   bytes together, and kills the program at the wall-clock timeout or the
   output limit; once the program has exited, it kills what it left running
   and stops reading. Killing means every process of the leaf, or the reaper's
   whole tree, or (in a pid namespace, which dies with its first process) the
   process group: a process that made a session of its own dies too.
5. The status is read from how it ended (``result.classify``; "memory" when
   the kernel killed processes at the leaf's bound), the leaf and the
   directory are removed.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from workers.sandbox import cgroup as _cgroup
from workers.sandbox import isolation as _isolation
from workers.sandbox.limits import SandboxLimits
from workers.sandbox.result import ERROR, KILLED, MEMORY, OK, SANDBOX_ERROR, SandboxResult, classify

__all__ = ["LANGUAGES", "check_files", "run", "run_at_level"]

LANGUAGES = ("python",)
_READ_CHUNK = 65536
_EXIT_GRACE_S = 0.2  # after the program exits, how long to drain output its leftovers may still write
# How the launch tools say they failed (the program never ran).
_TOOL_FAILURE_PREFIXES = ("bwrap: ", "unshare: ", "setpriv: ", "prlimit: ", "hybridflow-sandbox: ")
_REAPER = str(Path(__file__).with_name("reaper.py"))


def check_files(files: Mapping[str, str | bytes] | None) -> dict[str, bytes]:
    """``files`` as ``{relative posix path: bytes}``; ValueError for a name that escapes the work dir."""
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise ValueError(f"files must be a mapping of relative file names to str or bytes, got {type(files).__name__}")
    out: dict[str, bytes] = {}
    for name, content in files.items():
        if not isinstance(name, str) or not name or "\0" in name:
            raise ValueError(f"file name {name!r} must be a non-empty string without NUL characters")
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts or name.startswith("~"):
            raise ValueError(f"file name {name!r} escapes the sandbox's work dir; names must be relative paths "
                             f"without '..' (like 'data.txt' or 'inputs/case1.txt')")
        normal = path.as_posix()
        if normal in ("", "."):
            raise ValueError(f"file name {name!r} names the work dir itself, not a file in it")
        if normal == _isolation.PROGRAM_NAME:
            raise ValueError(f"file name {name!r} is the program's own file ({_isolation.PROGRAM_NAME}); "
                             f"choose another name")
        if isinstance(content, str):
            content = content.encode("utf-8")
        elif not isinstance(content, (bytes, bytearray)):
            raise ValueError(f"file {name!r}: content must be str or bytes, got {type(content).__name__}")
        if normal in out:
            raise ValueError(f"file name {name!r} is given twice (as {normal!r})")
        out[normal] = bytes(content)
    names = set(out)
    for normal in names:
        for parent in PurePosixPath(normal).parents:
            if parent.as_posix() in names:
                raise ValueError(f"file name {normal!r} needs {parent.as_posix()!r} to be a directory, "
                                 f"but it is also given as a file")
    return out


def _check_code(code: Any, language: Any) -> None:
    if language not in LANGUAGES:
        raise ValueError(f"language {language!r} is not supported; the languages are {list(LANGUAGES)}")
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")


def _stdin_bytes(stdin: Any) -> bytes | None:
    if stdin is None:
        return None
    if isinstance(stdin, str):
        return stdin.encode("utf-8")
    if isinstance(stdin, (bytes, bytearray)):
        return bytes(stdin)
    raise ValueError(f"stdin must be None, str or bytes, got {type(stdin).__name__}")


def _limits(limits: SandboxLimits | None, timeout: Any, memory: Any) -> SandboxLimits:
    if limits is None:
        limits = SandboxLimits()
    elif not isinstance(limits, SandboxLimits):
        raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    return limits.replace(timeout=timeout, memory=memory)


def run(code: str, language: str = "python", stdin: str | bytes | None = None, timeout: float | None = None,
        memory: int | None = None, files: Mapping[str, str | bytes] | None = None, *,
        limits: SandboxLimits | None = None, isolation: str | None = None) -> SandboxResult:
    """Run ``code`` in a sandbox and return what happened (see ``SandboxResult`` for the statuses).

    ``timeout`` (seconds) and ``memory`` (bytes) override those of ``limits``
    (``SandboxLimits()`` by default); ``files`` are written into the work dir
    first; ``isolation`` forces a level (default: ``$HYBRIDFLOW_SANDBOX``,
    else the strongest that runs here). Raises ValueError only for bad
    arguments.
    """
    _check_code(code, language)
    stdin_data = _stdin_bytes(stdin)
    limits = _limits(limits, timeout, memory)
    checked = check_files(files)
    level = _isolation.resolve_level(isolation)
    return _run(level, code, stdin_data, checked, limits)


def run_at_level(level: str, code: str, stdin: str | bytes | None = None,
                 files: Mapping[str, str | bytes] | None = None, limits: SandboxLimits | None = None) -> SandboxResult:
    """``run`` at ``level`` without checking that it runs here (what detection probes with)."""
    _check_code(code, "python")
    return _run(level, code, _stdin_bytes(stdin), check_files(files), limits or SandboxLimits())


def _write_tree(staging: Path, code: str, files: dict[str, bytes]) -> Path:
    work, tmp = staging / "work", staging / "tmp"
    work.mkdir()
    tmp.mkdir()
    for name, content in files.items():
        path = work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    (work / _isolation.PROGRAM_NAME).write_text(code, encoding="utf-8")
    uid = _isolation.sandbox_uid()
    if uid is not None:  # the program runs as another uid: its work dir and TMPDIR must be its own
        for path in [staging, work, tmp, *work.rglob("*")]:
            os.chown(path, uid, _isolation.SANDBOX_GID, follow_symlinks=False)
        os.chmod(staging, 0o711)
    return work


def _kill_group(pgid: int) -> None:
    """SIGKILL to every process of the group (one signal reaches all of them, forks in progress included)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Program:
    """What holds one running program's processes, and how to end all of them: its cgroup leaf where there is
    one (every process, whatever sessions it made), else its process group; at limits-only without a leaf, a
    reaper first (``reaper.py``), which outlives the program and kills what it left."""

    def __init__(self, level: str, limits: SandboxLimits) -> None:
        self.leaf = _cgroup.create(limits)
        self.reaper = self.leaf is None and level == _isolation.LIMITS_ONLY
        self.proc: subprocess.Popen | None = None  # its first process, once started

    def argv(self, argv: list[str]) -> list[str]:
        if self.reaper:
            argv = [_isolation.interpreter(), "-I", "-S", _REAPER, *argv]
        if self.leaf is not None:
            argv = _cgroup.join_argv(self.leaf, argv)
        return argv

    def stop(self) -> None:
        """Kill the program and everything it made (the first process too, once the reaper is done)."""
        if self.proc is None:
            return
        if self.reaper and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the reaper kills the program's whole tree, then exits
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self.proc.pid)
        if self.leaf is not None:
            self.leaf.kill_all()

    def memory_note(self, limits: SandboxLimits) -> str | None:
        """Why the kernel killed the program's processes, if it did at the leaf's memory bound."""
        kills = self.leaf.oom_kills() if self.leaf is not None else 0
        if not kills:
            return None
        return (f"hybridflow-sandbox: the program's processes together passed the memory bound "
                f"({limits.memory} bytes); the kernel killed {kills} of them")

    def close(self) -> None:
        if self.leaf is not None:
            self.leaf.kill_all()
            self.leaf.remove()


def _sandbox_error(level: str, message: str, started: float) -> SandboxResult:
    return SandboxResult(SANDBOX_ERROR, "", message, None, time.monotonic() - started, level)


def _run(level: str, code: str, stdin: bytes | None, files: dict[str, bytes], limits: SandboxLimits) -> SandboxResult:
    started = time.monotonic()
    try:
        staging = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-"))
    except OSError as exc:
        return _sandbox_error(level, f"the sandbox's work dir could not be made: {exc}", started)
    status_read = status_write = None
    try:
        try:
            work = _write_tree(staging, code, files)
        except OSError as exc:  # the machine's disk, not the program: the program never ran
            return _sandbox_error(level, f"the sandbox's files could not be written: {exc}", started)
        if level == "bwrap":
            status_read, status_write = os.pipe()
        try:
            spec = _isolation.launch(level, staging, work, limits, status_write)
            program = _Program(level, limits)
        except OSError as exc:
            return _sandbox_error(level, f"the sandbox could not be prepared: {exc}", started)
        try:
            return _start(program, spec, level, stdin, limits, started, status_read, status_write)
        finally:
            status_write = None  # closed by _start
            program.close()
    finally:
        for fd in (status_read, status_write):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)


def _start(program: _Program, spec, level: str, stdin: bytes | None, limits: SandboxLimits, started: float,
           status_read: int | None, status_write: int | None) -> SandboxResult:
    try:
        try:
            proc = subprocess.Popen(
                program.argv(spec.argv), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=spec.cwd, env=spec.env,
                pass_fds=spec.pass_fds, start_new_session=True, preexec_fn=spec.preexec_fn, **spec.popen_kwargs)
        except (OSError, subprocess.SubprocessError) as exc:
            return _sandbox_error(level, f"the sandbox could not start: {exc}", started)
    finally:
        for fd in spec.close_after_start:
            os.close(fd)
        if status_write is not None:
            os.close(status_write)
    program.proc = proc
    result = _supervise(proc, program, level, stdin, limits, started, status_read)
    note = program.memory_note(limits)
    if note is not None and result.status in (OK, ERROR, KILLED):  # killed for the memory of all its processes
        result = dataclasses.replace(result, status=MEMORY, stderr=result.stderr + ("\n" if result.stderr else "") + note)
    if program.leaf is not None:
        result = dataclasses.replace(result, peak_memory_bytes=program.leaf.peak_bytes())
    return result


def _supervise(proc: subprocess.Popen, program: _Program, level: str, stdin: bytes | None, limits: SandboxLimits, started: float,
               status_read: int | None) -> SandboxResult:
    deadline = started + limits.timeout
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    captured = 0
    timed_out = output_exceeded = False
    exited_at: float | None = None
    selector = selectors.DefaultSelector()
    for pipe in (proc.stdout, proc.stderr):
        os.set_blocking(pipe.fileno(), False)
        selector.register(pipe.fileno(), selectors.EVENT_READ)
    pending = memoryview(stdin) if stdin is not None else None
    if proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        if pending:
            selector.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    try:
        while any(key.events & selectors.EVENT_READ for key in selector.get_map().values()):
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
                program.stop()  # what the program left running
            if exited_at is not None and now - exited_at > _EXIT_GRACE_S:
                break
            if exited_at is None and now >= deadline:
                timed_out = True
                break
            wait = min(deadline - now, 0.05) if exited_at is None else _EXIT_GRACE_S
            for key, events in selector.select(max(wait, 0.0)):
                fd = key.fd
                if events & selectors.EVENT_WRITE:
                    try:
                        written = os.write(fd, pending[:_READ_CHUNK])
                        pending = pending[written:]
                    except BlockingIOError:
                        continue
                    except OSError:  # the program closed stdin (EPIPE): the rest is not wanted
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    data = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno != errno.EIO:
                        raise
                    data = b""
                if not data:
                    selector.unregister(fd)
                    continue
                room = limits.output - captured
                if len(data) > room:
                    chunks[fd].append(data[:room])
                    captured = limits.output
                    output_exceeded = True
                    break
                chunks[fd].append(data)
                captured += len(data)
            if output_exceeded:
                break
    except BaseException:
        program.stop()
        raise
    finally:
        selector.close()
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    if timed_out or output_exceeded:
        program.stop()
    try:  # a program that closed its stdout and stderr may still be running: the deadline holds
        returncode = proc.wait(timeout=10 if timed_out or output_exceeded else max(deadline - time.monotonic(), 0) + 0.1)
    except subprocess.TimeoutExpired:
        timed_out = True
        program.stop()
        returncode = proc.wait()
    program.stop()  # whatever it left running (the group outlives its reaped leader)
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()
    duration = time.monotonic() - started
    stdout_text = b"".join(chunks[out_fd]).decode("utf-8", errors="replace")
    stderr_text = b"".join(chunks[err_fd]).decode("utf-8", errors="replace")
    if level == "bwrap" and returncode is not None and 128 < returncode < 128 + 65:
        returncode = -(returncode - 128)  # bwrap reports a death by signal N as exit code 128 + N
    never_ran = status_read is not None and not _bwrap_started(status_read)
    if not timed_out and not output_exceeded and (never_ran or _tool_failed(returncode, stderr_text)):
        return SandboxResult(SANDBOX_ERROR, stdout_text, stderr_text, None, duration, level)
    status = classify(returncode, stderr_text, timed_out=timed_out, output_exceeded=output_exceeded)
    return SandboxResult(status, stdout_text, stderr_text, returncode, duration, level, output_exceeded)


def _bwrap_started(status_read: int) -> bool:
    """Whether bwrap reported its child's pid on ``--json-status-fd`` (it did not when its setup failed)."""
    os.set_blocking(status_read, False)
    data = b""
    try:
        while chunk := os.read(status_read, _READ_CHUNK):
            data += chunk
    except BlockingIOError:
        pass
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            if "child-pid" in json.loads(line):
                return True
        except (ValueError, TypeError):
            continue
    return False


def _tool_failed(returncode: int | None, stderr: str) -> bool:
    """The launch chain (unshare, setpriv, prlimit) failed before the program ran."""
    return returncode in (1, 126, 127) and stderr.startswith(_TOOL_FAILURE_PREFIXES)

