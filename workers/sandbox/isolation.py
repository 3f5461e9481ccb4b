"""Isolation levels: which the machine allows (probed once, cached), and the command line of each.

Three levels, strongest first. Which one runs, in order of precedence:

1. ``run(..., isolation=...)``;
2. the process default, ``set_default_isolation`` (a job's ``sandbox.isolation``,
   set in its reward and rollout workers);
3. ``$HYBRIDFLOW_SANDBOX``;
4. "auto": the first of bwrap and unshare that runs a probe program here.

"auto" never falls back to limits-only, which isolates nothing: a machine
with neither bwrap nor unshare refuses to run code (RuntimeError naming why
each failed and how to install bubblewrap) unless limits-only is asked for by
name. A named level that does not run here is a ValueError naming the ones
that do.

**bwrap** (bubblewrap): a new mount, pid, network, ipc and uts namespace
and a new session; the root is an empty tmpfs holding only ``/usr`` (with the
``/bin``, ``/lib*`` links), ``/etc/ld.so.cache`` and Python's install
directory, all read-only, a fresh ``/proc`` and minimal ``/dev``, a ``/tmp``
tmpfs and the work dir ``/sandbox``, a tmpfs into which the files are
copied (both tmpfs of ``limits.disk`` bytes). Nothing of the trainer's
repository, home, temp files or environment is there, and the network has
only its own loopback. ``--die-with-parent``: the sandbox dies with the
trainer. The program runs as uid/gid 65534 without capabilities or
supplementary groups, with no-new-privs, in a user namespace of its own, so
its process limit counts its own processes only.

- When the parent is root, bwrap runs as root without a user namespace
  (root needs none to create the others) and the program drops to 65534
  inside it (``setpriv``), then enters a user namespace of its own
  (``unshare --user``): root ignores RLIMIT_NPROC, and so does any process
  whose uid maps to root, so a user namespace made by root (bwrap's
  ``--unshare-user`` as root) would not contain a fork bomb. Measured here:
  it does not.
- When the parent is not root, bwrap runs unprivileged with
  ``--unshare-user --disable-userns``; the program keeps the parent's uid.

**unshare** (util-linux): new network, pid, ipc and uts namespaces (no
network but an unconfigured loopback; the program is pid 1 of its pid
namespace, so all its processes die with it), no filesystem isolation: it
sees the host's files as uid 65534 sees them (a root parent drops it there;
when Python's install is not readable by that uid, as with an interpreter
under a 0700 ``/root``, the program keeps CAP_DAC_READ_SEARCH and so can
read, not write, every file). Not root: ``unshare --user --map-current-user``
and the parent's uid.

**limits-only**: the resource limits, the scrubbed environment, the temporary
work dir and (under a root parent) uid 65534, nothing else: the program
shares the host's network, pids and files (as that uid sees them, with
CAP_DAC_READ_SEARCH as above when needed). Under a non-root parent it runs
as the parent's uid and could signal the trainer's processes.

At every level: the interpreter is ``sys.executable`` resolved to its real
binary, run with ``-I -B`` (isolated mode: the base installation's packages,
not the trainer's virtual environment), the environment is only
``sandbox_env`` (PATH, LANG, HOME, TMPDIR, ...), the process group is killed
at the timeout, and the resource limits are set by ``prlimit``.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from workers.sandbox.limits import SandboxLimits, rlimit_values

__all__ = ["AUTO", "ENV_VAR", "ISOLATING", "LEVELS", "LIMITS_ONLY", "SANDBOX_GID", "SANDBOX_UID", "WORK_DIR_INSIDE", "Launch", "LevelFacts",
           "available_levels", "interpreter", "isolation_level", "level_facts", "launch", "resolve_level",
           "sandbox_env", "set_default_isolation", "unavailable_reasons"]

LEVELS = ("bwrap", "unshare", "limits-only")
ISOLATING = ("bwrap", "unshare")  # the levels "auto" picks from; limits-only is only ever asked for by name
AUTO = "auto"
LIMITS_ONLY = "limits-only"
ENV_VAR = "HYBRIDFLOW_SANDBOX"
SANDBOX_UID = SANDBOX_GID = 65534  # "nobody": the uid a root parent runs programs as
WORK_DIR_INSIDE = "/sandbox"  # the program's work dir under bwrap
PROGRAM_NAME = "main.py"
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # bound (or linked) beside /usr


def _is_root() -> bool:
    return os.geteuid() == 0


def _which(name: str) -> str | None:
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), _SYSTEM_PATH]))
    return os.path.realpath(found) if found else None


def interpreter() -> str:
    """The real binary of ``sys.executable`` (a virtual environment's symlink resolved)."""
    return os.path.realpath(sys.executable)


def _python_roots() -> list[str]:
    """Python's install directories outside ``/usr``: what bwrap binds read-only beside the system's."""
    exe = interpreter()
    candidates = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    if not any(exe.startswith(c.rstrip("/") + "/") for c in candidates):
        candidates.add(os.path.dirname(os.path.dirname(exe)))  # an interpreter copied into a venv
    roots = []
    for path in sorted(candidates, key=len):
        if path in ("/", "") or path == "/usr" or path.startswith("/usr/"):
            continue
        if any(path.startswith(r.rstrip("/") + "/") for r in roots):
            continue
        roots.append(path)
    return roots


def _readable_by_others(paths: list[str]) -> bool:
    """Whether an unprivileged uid can reach and read ``paths`` (every ancestor o+x, each path o+r)."""
    for path in paths:
        p = Path(path)
        for ancestor in list(p.parents)[::-1]:
            try:
                mode = ancestor.stat().st_mode
            except OSError:
                return False
            if not mode & stat.S_IXOTH:
                return False
        try:
            if not p.stat().st_mode & stat.S_IROTH:
                return False
        except OSError:
            return False
    return True


def _stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


@dataclass(frozen=True)
class LevelFacts:
    """What a level guarantees on this machine, as the tests and the docs read it."""

    level: str
    uid: int  # the program's uid as the host sees it
    host_files_hidden: bool  # the trainer's repository, home and temp files are not there at all
    reads_any_file: bool  # the program keeps CAP_DAC_READ_SEARCH (reads, never writes, every file)
    network_isolated: bool  # a network namespace of its own
    pid_namespace: bool  # cannot see or signal the host's processes; all its processes die with it
    own_process_count: bool  # RLIMIT_NPROC counts this program's processes only (a user namespace)


def level_facts(level: str) -> LevelFacts:
    """The guarantees of ``level`` for a parent with this uid and this interpreter."""
    if level not in LEVELS:
        raise ValueError(f"unknown sandbox isolation level {level!r}; the levels are {list(LEVELS)}")
    root = _is_root()
    uid = SANDBOX_UID if root else os.getuid()
    readable = _readable_by_others([interpreter(), _stdlib_dir()])
    if level == "bwrap":
        return LevelFacts(level, uid, True, False, True, True, True)
    keeps_read = root and not readable and _which("setpriv") is not None
    if root and _which("setpriv") is None and not readable:
        uid = 0  # no way to drop privileges and still load Python: runs as root
    if level == "unshare":
        return LevelFacts(level, uid, False, keeps_read, True, True, (not root) or readable)
    return LevelFacts(level, uid, False, keeps_read, False, False, False)


def sandbox_env(home: str, tmpdir: str) -> dict[str, str]:
    """The whole environment a sandboxed program gets: nothing of the trainer's."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": home,
        "TMPDIR": tmpdir,
        "PYTHONDONTWRITEBYTECODE": "1",  # (-I ignores PYTHON* variables; this reaches child interpreters)
        "PYTHONIOENCODING": "utf-8",
    }


@dataclass
class Launch:
    """How to start one program: the command line and what ``subprocess.Popen`` needs beside it."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    pass_fds: tuple[int, ...] = ()
    close_after_start: list[int] = field(default_factory=list)  # fds the parent closes once it started
    preexec_fn: Callable[[], None] | None = None
    popen_kwargs: dict = field(default_factory=dict)  # user / group / extra_groups when setpriv is missing


def _prlimit_args(prlimit: str, limits: SandboxLimits, nproc: int | None = None) -> list[str]:
    values = rlimit_values(limits)
    if nproc is not None:
        values["RLIMIT_NPROC"] = (nproc, nproc)
    names = {"RLIMIT_CPU": "cpu", "RLIMIT_AS": "as", "RLIMIT_NPROC": "nproc", "RLIMIT_FSIZE": "fsize",
             "RLIMIT_NOFILE": "nofile", "RLIMIT_CORE": "core"}
    return [prlimit, *(f"--{names[k]}={soft}:{hard}" for k, (soft, hard) in values.items()), "--"]


def _setrlimits(limits: SandboxLimits, nproc: int | None = None) -> Callable[[], None]:
    """A preexec_fn setting the limits (only where prlimit is missing: preexec_fn is not thread-safe)."""
    import resource

    values = [(getattr(resource, k), v) for k, v in rlimit_values(limits).items()]
    if nproc is not None:
        values = [(r, (nproc, nproc) if r == resource.RLIMIT_NPROC else v) for r, v in values]

    def apply() -> None:
        for res, value in values:
            resource.setrlimit(res, value)

    return apply


def _setpriv_args(setpriv: str, keep_read: bool) -> list[str]:
    caps = "-all,+dac_read_search" if keep_read else "-all"
    args = [setpriv, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_GID}", "--clear-groups", f"--inh-caps={caps}"]
    if keep_read:
        args.append("--ambient-caps=+dac_read_search")
    return [*args, f"--bounding-set={caps}", "--no-new-privs", "--"]


def _user_task_count(uid: int) -> int:
    """Processes and threads of ``uid`` now (RLIMIT_NPROC counts them all)."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def _python_argv() -> list[str]:
    return [interpreter(), "-I", "-B", PROGRAM_NAME]


def _bwrap_launch(staging: Path, work: Path, limits: SandboxLimits, status_fd: int | None) -> Launch:
    tools = {name: _which(name) for name in ("bwrap", "prlimit", "setpriv", "unshare")}
    root = _is_root()
    needed = ["bwrap", "prlimit"] + (["setpriv", "unshare"] if root else [])
    missing = [n for n in needed if tools[n] is None]
    if missing:
        raise _Unavailable(f"{', '.join(missing)} not found")
    argv = [tools["bwrap"], "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session"]
    if not root:
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in _SYSTEM_LINKS:
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    made = {"/", "/usr", *_SYSTEM_LINKS}
    for root_dir in _python_roots():
        for parent in [str(p) for p in Path(root_dir).parents][::-1]:
            if parent not in made:
                argv += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        argv += ["--ro-bind", root_dir, root_dir]
    size = str(limits.disk)
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", size, "--perms", "1777", "--tmpfs", "/tmp",
             "--size", size, "--perms", "0777", "--tmpfs", WORK_DIR_INSIDE]
    fds: list[int] = []
    try:
        for path in sorted(work.rglob("*")):
            inside = f"{WORK_DIR_INSIDE}/{path.relative_to(work).as_posix()}"
            if path.is_dir():
                argv += ["--perms", "0777", "--dir", inside]
            else:
                fd = os.open(path, os.O_RDONLY)
                fds.append(fd)
                argv += ["--perms", "0666", "--file", str(fd), inside]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    env = sandbox_env(WORK_DIR_INSIDE, "/tmp")
    argv += ["--chdir", WORK_DIR_INSIDE, "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    if status_fd is not None:
        argv += ["--json-status-fd", str(status_fd)]
        fds.append(status_fd)
    argv.append("--")
    if root:
        argv += _setpriv_args(tools["setpriv"], keep_read=False)
        argv += [tools["unshare"], "--user", "--map-current-user", "--"]  # a process count of its own
    argv += _prlimit_args(tools["prlimit"], limits) + _python_argv()
    return Launch(argv, env, str(staging), tuple(fds), [fd for fd in fds if fd != status_fd])


def _unprivileged_chain(limits: SandboxLimits, level: str) -> tuple[list[str], Launch]:
    """The part of an unshare / limits-only command that drops privileges and sets the limits.

    At the unshare level the program gets a user namespace of its own (``unshare --user``), so that
    RLIMIT_NPROC counts its processes only: from a root parent once it runs as 65534 (and only when
    Python is readable by that uid: entering the namespace loses CAP_DAC_READ_SEARCH on the host's
    files), from a non-root parent through the outer ``unshare --user``.
    """
    prlimit, setpriv, unshare = _which("prlimit"), _which("setpriv"), _which("unshare")
    launch = Launch([], {}, "")
    prefix: list[str] = []
    nproc = None
    if _is_root():
        readable = _readable_by_others([interpreter(), _stdlib_dir()])
        if setpriv:
            prefix += _setpriv_args(setpriv, keep_read=not readable)
            if readable and level == "unshare" and unshare:
                prefix += [unshare, "--user", "--map-current-user", "--"]  # a process count of its own
        elif readable:
            launch.popen_kwargs = {"user": SANDBOX_UID, "group": SANDBOX_GID, "extra_groups": []}
    elif level == LIMITS_ONLY:
        nproc = _user_task_count(os.getuid()) + limits.processes  # RLIMIT_NPROC counts all the uid's tasks
    if prlimit:
        prefix += _prlimit_args(prlimit, limits, nproc)
    else:
        launch.preexec_fn = _setrlimits(limits, nproc)
    return prefix, launch


def _unshare_launch(staging: Path, work: Path, limits: SandboxLimits) -> Launch:
    unshare = _which("unshare")
    if unshare is None:
        raise _Unavailable("unshare not found")
    namespaces = ["--net", "--ipc", "--uts", "--pid", "--fork", "--kill-child"]
    if _is_root():
        outer = [unshare, *namespaces, "--"]
    else:
        outer = [unshare, "--user", "--map-current-user", *namespaces, "--"]
    inner, launch = _unprivileged_chain(limits, "unshare")
    launch.argv = outer + inner + _python_argv()
    launch.env = sandbox_env(str(work), str(staging / "tmp"))
    launch.cwd = str(work)
    return launch


def _limits_only_launch(staging: Path, work: Path, limits: SandboxLimits) -> Launch:
    inner, launch = _unprivileged_chain(limits, LIMITS_ONLY)
    launch.argv = inner + _python_argv()
    launch.env = sandbox_env(str(work), str(staging / "tmp"))
    launch.cwd = str(work)
    return launch


class _Unavailable(RuntimeError):
    """A level cannot run here (a tool is missing); the reason is the message."""


def launch(level: str, staging: Path, work: Path, limits: SandboxLimits, status_fd: int | None = None) -> Launch:
    """The command that runs ``work/main.py`` at ``level`` (``staging`` holds ``work`` and ``tmp``)."""
    if level == "bwrap":
        return _bwrap_launch(staging, work, limits, status_fd)
    if level == "unshare":
        return _unshare_launch(staging, work, limits)
    if level == LIMITS_ONLY:
        return _limits_only_launch(staging, work, limits)
    raise ValueError(f"unknown sandbox isolation level {level!r}; the levels are {list(LEVELS)}")


def sandbox_uid() -> int | None:
    """The uid the program runs as, when it differs from the parent's (a root parent), else None."""
    return SANDBOX_UID if _is_root() else None


# -- detection -------------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_probed: dict[str, str | None] = {}  # level -> None (works) or why it does not


def _probe(level: str) -> str | None:
    """None if a trivial program runs at ``level`` and prints what it should, else why not."""
    from workers.sandbox.runner import run_at_level

    try:
        result = run_at_level(level, "print('sandbox ok')", limits=SandboxLimits(timeout=20))
    except _Unavailable as exc:
        return str(exc)
    if result.status == "ok" and result.stdout.strip() == "sandbox ok":
        return None
    detail = (result.stderr.strip().splitlines() or [""])[-1][:300]
    return f"the probe program ended with status {result.status!r}" + (f": {detail}" if detail else "")


def _probe_cached(level: str) -> str | None:
    with _lock:
        if level not in _probed:
            _probed[level] = _probe(level)
        return _probed[level]


def available_levels() -> list[str]:
    """Every level that runs here, strongest first (each probed once per process)."""
    return [level for level in LEVELS if _probe_cached(level) is None]


def unavailable_reasons() -> dict[str, str]:
    """``{level: why it does not run here}`` for the levels that do not."""
    return {level: reason for level in LEVELS if (reason := _probe_cached(level)) is not None}


_default: str | None = None  # set_default_isolation's level, or None


def set_default_isolation(level: str | None) -> None:
    """The level every later ``run`` in this process uses when it names none (None: back to the
    environment variable, then "auto"). Checked now: ValueError for a name that is not a level or
    "auto" (a level that does not run here fails at the first ``run``, naming those that do)."""
    global _default
    if level is not None and level != AUTO and level not in LEVELS:
        raise ValueError(f"sandbox isolation {level!r} is not one of {[AUTO, *LEVELS]}")
    _default = None if level == AUTO else level


def _no_isolation_message() -> str:
    reasons = unavailable_reasons()
    why = "; ".join(f"{level}: {reasons[level]}" for level in ISOLATING if level in reasons)
    return (f"the sandbox cannot isolate code on this machine ({why}). Install bubblewrap (apt-get install "
            f"bubblewrap, or dnf install bubblewrap), or ask for resource limits alone, which do not isolate the "
            f"program's network, files or processes: isolation='{LIMITS_ONLY}' "
            f"(a job: sandbox.isolation={LIMITS_ONLY}; the environment: {ENV_VAR}={LIMITS_ONLY})")


def resolve_level(requested: str | None = None) -> str:
    """The level a ``run`` asking for ``requested`` uses (module docstring for the precedence).

    ValueError for an unknown name or a named level that does not run here
    (naming those that do); RuntimeError when "auto" finds no isolating level.
    """
    source = "isolation"
    if requested is None and _default is not None:
        requested, source = _default, "sandbox.isolation"
    if requested is None and os.environ.get(ENV_VAR):
        requested, source = os.environ[ENV_VAR], ENV_VAR
    if requested is None or requested == AUTO:
        for level in ISOLATING:
            if _probe_cached(level) is None:
                return level
        raise RuntimeError(_no_isolation_message())
    if requested not in LEVELS:
        raise ValueError(f"{source}={requested!r} is not a sandbox isolation level; the levels are "
                         f"{[AUTO, *LEVELS]}")
    reason = _probe_cached(requested)
    if reason is not None:
        raise ValueError(f"{source}={requested!r}: that isolation level does not run here ({reason}); "
                         f"available: {available_levels()}")
    return requested


def isolation_level() -> str:
    """The level ``run`` uses by default here (``$HYBRIDFLOW_SANDBOX`` if set)."""
    return resolve_level(None)
