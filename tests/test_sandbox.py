"""The sandbox for model-written code (workers/sandbox): each escape contained and named, the trainer unharmed.

The escape tests run at every isolation level this machine has (bwrap, unshare, limits-only; a level that does
not run here is skipped with the reason) and assert what that level guarantees (``level_facts``); the rest run
at the default level. Every sandboxed program is a fresh short process (about 40 ms); the last test is a
2-step CLI run of examples/code_expression.yaml (about 20 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hybridflow.sandbox import (
    LEVELS,
    STATUSES,
    Sandbox,
    SandboxLimits,
    available_levels,
    isolation_level,
    level_facts,
    run,
    run_many,
)
import sandbox_escapes as escapes
from workers.sandbox import cgroup
from workers.sandbox.isolation import ENV_VAR, unavailable_reasons

ROOT = Path(__file__).resolve().parents[1]
AVAILABLE = available_levels()
LEVEL_PARAMS = [pytest.param(level, marks=pytest.mark.skipif(
    level not in AVAILABLE, reason=f"isolation level {level!r} does not run here: {unavailable_reasons().get(level)}"))
    for level in LEVELS]
ISOLATING = [level for level in AVAILABLE if level != "limits-only"]
MARK = ["-I", "-B", "main.py"]  # the tail of every sandboxed interpreter's command line (and its forks')


def _sandbox_processes(uid: int) -> list[tuple[int, str]]:
    """(pid, state) of live processes that are sandboxed programs (their forks too): psutil if installed, else /proc."""
    found = []
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        for proc in psutil.process_iter(["pid", "cmdline", "uids", "status"]):
            try:
                cmdline, uids, state = proc.info["cmdline"] or [], proc.info["uids"], proc.info["status"]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            ours = cmdline[-3:] == MARK or (uid != os.getuid() and uids is not None and uids.real == uid)
            if ours and state != psutil.STATUS_ZOMBIE:
                found.append((proc.info["pid"], state))
        return found
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")[:-1]
            status = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        state, real_uid = status["State"].split()[0], int(status["Uid"].split()[0])
        ours = [c.decode(errors="replace") for c in cmdline[-3:]] == MARK or (uid != os.getuid() and real_uid == uid)
        if ours and state != "Z":
            found.append((int(entry.name), state))
    return found


@pytest.fixture(autouse=True)
def _default_level(monkeypatch):
    """On a machine that cannot isolate (no bwrap, no unshare), the tests at the default level say limits-only
    explicitly, as a user must; the escape tests still run at every level there is."""
    if not ISOLATING:
        monkeypatch.setenv(ENV_VAR, "limits-only")


def _sandbox_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("hybridflow-sandbox-*")}


# -- escapes, at every level --------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVEL_PARAMS)
def test_an_infinite_loop_is_killed_at_the_timeout(level):
    result = run("while True:\n    pass\n", timeout=1.0, isolation=level)
    assert result.status == "timeout", result
    assert result.isolation == level
    assert 1.0 <= result.duration_s < 1.0 + 2.0, result.duration_s


@pytest.mark.parametrize("level", LEVEL_PARAMS)
def test_a_fork_bomb_hits_the_process_limit_and_leaves_no_process(level):
    facts = level_facts(level)
    # Keeps forking whatever fails; each process reports the first fork the limit refused (EAGAIN).
    bomb = ("import os\nrefused = False\nwhile True:\n    try:\n        os.fork()\n    except OSError as exc:\n"
            "        if not refused:\n            print('EAGAIN' if exc.errno == 11 else exc, flush=True)\n"
            "            refused = True\n")
    limits = SandboxLimits(timeout=2.0, processes=32)
    result = run(bomb, limits=limits, isolation=level)
    assert result.status == "timeout", result.summary()
    assert result.duration_s < 2.0 + 2.0, result.duration_s
    # The limit was hit (a fork refused with EAGAIN), by at most `processes` processes.
    lines = result.stdout.split()
    assert lines and set(lines) == {"EAGAIN"}, result.stdout[:300]
    assert len(lines) <= limits.processes
    # Nothing of it is left running (dead processes the machine's init has yet to reap are not running).
    deadline = time.monotonic() + 2.0
    while (left := _sandbox_processes(facts.uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], left


@pytest.mark.parametrize("level", LEVEL_PARAMS)
def test_six_children_of_300_mb_are_bounded_as_one_program(level):
    """The memory bound is the whole program's: in a cgroup leaf (root here, or a delegated cgroup) the kernel
    kills children past 512 MiB in all and the status says so; without one, the documented bound is
    memory x processes, and with 4 processes the fourth fork is refused."""
    facts = level_facts(level)
    limits = SandboxLimits(timeout=20.0) if cgroup.available() else SandboxLimits(timeout=20.0, processes=4)
    result = run(escapes.SIX_CHILDREN, limits=limits, isolation=level)
    if cgroup.available():
        # the most its processes held at once, as the leaf counted it: within the bound (1.8 GB before)
        assert result.peak_memory_bytes is not None and result.peak_memory_bytes <= limits.memory
        assert result.status == "memory", result.summary()
        assert result.stderr.splitlines()[-1].startswith(
            "hybridflow-sandbox: the program's processes together passed the memory bound (536870912 bytes)")
    else:
        assert result.status == "processes", result.summary()
    assert _sandbox_processes(facts.uid) == []


@pytest.mark.parametrize("level", LEVEL_PARAMS)
def test_a_child_in_a_session_of_its_own_dies_with_the_program(level):
    """setsid() leaves the program's process group; the cgroup leaf, the pid namespace or the reaper (limits-only
    without a cgroup) still ends it with the program."""
    facts = level_facts(level)
    result = run(escapes.SETSID_CHILD, timeout=10.0, isolation=level)
    assert result.status == "ok" and result.stdout.split() == ["grandchild", "done"], result.summary()
    deadline = time.monotonic() + 2.0
    while (left := _sandbox_processes(facts.uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], left


def _unprivileged_python() -> str | None:
    """A system interpreter an unprivileged uid can run (the project's may sit under a 0700 home)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(candidate)
        if os.path.exists(real) and os.stat(real).st_mode & 0o005 == 0o005:
            return real
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="this run is unprivileged already: the tests above take that path")
def test_every_escape_is_contained_for_an_unprivileged_user_at_every_level():
    """The path a real deployment takes: the trainer as an ordinary user. The escapes above (and the two
    bounds) run as uid 65534, with a system interpreter, at every level that uid has (no cgroup of its
    own: the reaper holds a limits-only program's processes, the per-process bounds its memory)."""
    import shutil

    python, setpriv = _unprivileged_python(), shutil.which("setpriv")
    if python is None or setpriv is None:
        pytest.skip(f"needs setpriv and a system python3 that other users can run (found {setpriv}, {python})")
    package = Path(tempfile.mkdtemp(prefix="hybridflow-unprivileged-"))
    try:
        (package / "workers").mkdir()
        (package / "workers" / "__init__.py").write_text("")
        (package / "workers" / "sandbox").symlink_to(ROOT / "workers" / "sandbox")
        for path in (package, package / "workers", package / "workers" / "__init__.py"):
            path.chmod(0o755)
        proc = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                               "--bounding-set=-all", python, "-I", str(ROOT / "tests" / "sandbox_escapes.py"),
                               str(package)], capture_output=True, text=True, cwd=package, timeout=300,
                              env={"PATH": "/usr/bin:/bin", "TMPDIR": "/tmp"})
    finally:
        shutil.rmtree(package, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["uid"] == 65534 and report["cgroup"] is False
    assert "limits-only" in report["levels"], report["unavailable"]
    assert set(report["levels"]) >= set(ISOLATING) - {"bwrap"} or "unshare" in report["unavailable"]
    for level, outcomes in report["levels"].items():
        for name, outcome in outcomes.items():
            assert outcome["left"] == [], (level, name, outcome)
        got = {name: outcome["status"] for name, outcome in outcomes.items()}
        assert got == {"loop": "timeout", "fork_bomb": "timeout", "allocate_10_gb": "memory",
                       "write_1_gb": "file_size", "print_100_mb": "output", "six_children": "processes",
                       "setsid_child": "ok"}, (level, got)
        # at most `processes` of them, and (non-root limits-only: the uid's count at launch plus `processes`,
        # documented) a few more where the previous program's last processes were still exiting at launch
        bomb = outcomes["fork_bomb"]["stdout"].split()
        assert bomb and set(bomb) == {"EAGAIN"} and len(bomb) <= 32 + (4 if level == "limits-only" else 0), (level, len(bomb))
        assert outcomes["setsid_child"]["stdout"].split() == ["grandchild", "done"]
        # no cgroup: the bound is memory x processes (4 here), and the fourth fork is refused
        assert outcomes["six_children"]["memory_bound"] == 4 * 512 * 2**20


@pytest.mark.parametrize("level", LEVEL_PARAMS)
def test_allocating_10_gb_is_a_memory_error(level):
    result = run("data = bytearray(10 * 2**30)\nprint('allocated')", isolation=level)
    assert result.status == "memory", result.summary()
    assert "allocated" not in result.stdout


@pytest.mark.parametrize("level", LEVEL_PARAMS)
def test_writing_1_gb_stops_at_the_file_size_limit_and_leaves_nothing(level):
    before = _sandbox_dirs()
    code = "with open('big.bin', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2**20)\nprint('wrote 1 GB')"
    result = run(code, isolation=level)
    assert result.status == "file_size", result.summary()
    assert "[Errno 27] File too large" in result.stderr and "wrote 1 GB" not in result.stdout
    assert _sandbox_dirs() - before == set()  # the work dir, and the 16 MiB written, are gone


@pytest.mark.parametrize("level", LEVEL_PARAMS)
def test_the_trainers_environment_and_files_are_out_of_reach(level, tmp_path, monkeypatch):
    facts = level_facts(level)
    env_secret, file_secret = "env-secret-7f3a9c", "file-secret-b81d24"
    monkeypatch.setenv("HYBRIDFLOW_TEST_SECRET", env_secret)
    secret = tmp_path / "secret.txt"
    secret.write_text(file_secret)
    readme = ROOT / "README.md"
    code = f"""
import os
print(dict(os.environ))
for path in [{str(secret)!r}, {str(readme)!r}]:
    try:
        print(path, open(path).read()[:200])
    except OSError as exc:
        print(path, type(exc).__name__)
try:
    open({str(secret)!r}, 'a').write('overwritten')
    print('WROTE')
except OSError as exc:
    print('write', type(exc).__name__)
"""
    result = run(code, isolation=level)
    assert result.status == "ok", result.summary()
    seen = result.stdout + result.stderr
    # Every level: the environment is only the sandbox's own.
    assert env_secret not in seen and "HYBRIDFLOW_TEST_SECRET" not in seen
    env = eval(result.stdout.splitlines()[0])  # a dict's repr, from our own program
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING",
                        "PWD", "LC_CTYPE"}, env
    if facts.host_files_hidden:  # bwrap: neither file exists in the sandbox
        assert file_secret not in seen and "# hybridflow" not in seen
        assert f"{secret} FileNotFoundError" in result.stdout and f"{readme} FileNotFoundError" in result.stdout
    elif facts.uid != os.getuid() and not facts.reads_any_file:  # another uid: the test's 0700 tmp dir is closed
        assert file_secret not in seen
    # An unprivileged uid never writes the trainer's files (at every level under a root parent).
    if facts.uid != os.getuid():
        assert "WROTE" not in result.stdout and secret.read_text() == file_secret


@pytest.mark.parametrize("level", LEVEL_PARAMS)
def test_a_socket_to_the_trainers_port_fails_and_the_listener_accepts_nothing(level):
    if not level_facts(level).network_isolated:
        pytest.skip(f"the {level!r} level shares the host's network (no network namespace): documented, not contained")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                f"    print('CONNECTED')\nexcept OSError as exc:\n    print('refused', exc)\n")
        result = run(code, isolation=level)
        assert result.status == "ok", result.summary()
        assert "CONNECTED" not in result.stdout and "refused" in result.stdout
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()


@pytest.mark.parametrize("level", LEVEL_PARAMS)
def test_killing_its_parent_or_the_trainer_leaves_the_trainer_alive(level):
    facts = level_facts(level)
    if facts.uid == os.getuid() and not facts.pid_namespace:
        pytest.skip(f"the {level!r} level under a non-root parent runs as the trainer's uid in its pid namespace: "
                    "it can signal the trainer (documented)")
    trainer = os.getpid()
    code = (f"import os\nfor pid in (os.getppid(), {trainer}):\n    try:\n        os.kill(pid, 9)\n"
            f"        print(pid, 'sent')\n    except OSError as exc:\n        print(pid, type(exc).__name__)\n")
    result = run(code, isolation=level)
    os.kill(trainer, 0)  # still here (this line runs at all), and so is the supervisor's result:
    assert result.status in STATUSES and result.status != "sandbox_error", result
    assert result.isolation == level
    assert f"{trainer} sent" not in result.stdout, result.stdout


@pytest.mark.parametrize("level", LEVEL_PARAMS)
def test_printing_100_mb_is_cut_at_the_output_limit(level):
    result = run("print('x' * 100_000_000)", isolation=level)
    cap = SandboxLimits().output
    assert result.status == "output", result.summary()
    assert result.truncated and len(result.stdout) <= cap and len(result.stdout) > cap // 2
    assert set(result.stdout) == {"x"}
    assert result.duration_s < 5.0, result.duration_s


# -- the API, at the default level ---------------------------------------------------------------------------------


def test_a_correct_program_is_ok_with_its_stdout_stdin_and_files():
    result = run("print(sum(range(10)))")
    assert (result.status, result.stdout, result.returncode, result.isolation) == ("ok", "45\n", 0, isolation_level())
    assert run("import sys\nprint(sys.stdin.read()[::-1])", stdin="abc").stdout == "cba\n"
    files = {"data.txt": "hello", "inputs/case.bin": b"\x00\x01"}
    code = "import os\nprint(open('data.txt').read(), len(open('inputs/case.bin', 'rb').read()), sorted(os.listdir('.')))"
    assert run(code, files=files).stdout == "hello 2 ['data.txt', 'inputs', 'main.py']\n"


def test_a_failing_program_is_an_error_and_never_raises():
    result = run("raise ValueError('bad input')")
    assert result.status == "error" and result.returncode == 1 and "ValueError: bad input" in result.stderr
    assert run("import sys\nsys.exit(3)").returncode == 3
    assert run("import ctypes\nctypes.string_at(0)").status == "killed"  # a real fault (pid 1 ignores a kill(2))


@pytest.mark.parametrize("kwargs,named", [
    ({"language": "ruby"}, "'ruby'"),
    ({"timeout": -1}, "-1"),
    ({"memory": 0}, "memory"),
    ({"files": {"../escape.txt": "x"}}, "'../escape.txt'"),
    ({"files": {"/etc/passwd": "x"}}, "'/etc/passwd'"),
    ({"files": {"a/../../b": "x"}}, "'a/../../b'"),
    ({"files": {"main.py": "x"}}, "'main.py'"),
    ({"isolation": "docker"}, "'docker'"),
])
def test_bad_arguments_are_value_errors_naming_the_value(kwargs, named):
    with pytest.raises(ValueError) as info:
        run("print(1)", **kwargs)
    assert named in str(info.value)
    if "language" in kwargs:
        assert "['python']" in str(info.value)


def test_the_environment_variable_forces_a_level_and_refuses_an_unknown_one(monkeypatch):
    weakest = AVAILABLE[-1]
    monkeypatch.setenv(ENV_VAR, weakest)
    assert run("print(1)").isolation == weakest == isolation_level()
    monkeypatch.setenv(ENV_VAR, "chroot")
    with pytest.raises(ValueError, match=r"HYBRIDFLOW_SANDBOX='chroot'.*\['auto', 'bwrap', 'unshare', 'limits-only'\]"):
        run("print(1)")


@pytest.fixture
def no_isolation(monkeypatch):
    """A machine where neither bwrap nor unshare runs (the probes' cache says so), limits-only does."""
    from workers.sandbox import isolation

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(isolation, "_probed", {"bwrap": "bwrap not found", "unshare": "unshare: unshare failed: "
                                               "Operation not permitted", "limits-only": None})
    yield
    isolation.set_default_isolation(None)


def test_auto_never_falls_back_to_limits_only_which_runs_only_when_asked_for(no_isolation):
    from workers.sandbox import set_default_isolation

    with pytest.raises(RuntimeError) as info:
        run("print(1)")
    message = str(info.value)
    assert "cannot isolate" in message and "bwrap not found" in message and "Operation not permitted" in message
    assert "bubblewrap" in message and "sandbox.isolation=limits-only" in message
    assert run("print(1)", isolation="limits-only").isolation == "limits-only"
    set_default_isolation("limits-only")  # what a job's sandbox.isolation does in its workers
    assert run("print(1)").isolation == "limits-only"
    with pytest.raises(ValueError, match=r"sandbox.isolation='bwrap': that isolation level does not run here "
                                         r"\(bwrap not found\); available: \['limits-only'\]"):
        set_default_isolation("bwrap")
        run("print(1)")
    with pytest.raises(ValueError, match=r"sandbox isolation 'docker' is not one of \['auto', 'bwrap'"):
        set_default_isolation("docker")


def test_a_job_that_runs_code_is_refused_before_launch_where_the_sandbox_cannot_isolate(no_isolation):
    from controller.config import ConfigError, check_config, config_from_dict

    def check(**sections):
        check_config(config_from_dict({"data": {"task": "code_expression"}, **sections}))

    with pytest.raises(ConfigError, match=r"sandbox: the sandbox cannot isolate code on this machine"):
        check()  # reward.fn auto scores the code_expression task by running it
    with pytest.raises(ConfigError, match=r"sandbox: the sandbox cannot isolate"):
        check(data={"task": "arithmetic"}, reward={"fn": "code_exec"})
    with pytest.raises(ConfigError, match=r"sandbox: the sandbox cannot isolate"):
        check(data={"task": "word_problems"}, reward={"fn": "environment"},
              rollout={"agent": {"tools": ["calculator", "python"]}})
    check(sandbox={"isolation": "limits-only"})  # said explicitly: accepted
    check(data={"task": "arithmetic"})  # no code runs: the sandbox is not asked for
    with pytest.raises(ConfigError, match=r"sandbox.isolation 'nsjail' is not one of \['auto', 'bwrap', 'unshare', "
                                          r"'limits-only'\]"):
        check(sandbox={"isolation": "nsjail"})


def test_run_many_keeps_the_order_and_bounds_how_many_run_at_once():
    code = "import time\nstart = time.time()\ntime.sleep(0.8)\nprint({i}, start, time.time())"
    results = run_many([code.format(i=i) for i in range(4)], max_workers=2)
    spans = []
    for i, result in enumerate(results):
        index, start, end = result.stdout.split()
        assert result.ok and int(index) == i
        spans.append((float(start), float(end)))
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most == 2, spans  # two at once, never more


def test_a_sandbox_object_runs_from_threads_and_coroutines():
    async def main(box):
        return await asyncio.gather(*(box.arun(f"print({i} * 2)") for i in range(3)))

    with Sandbox(SandboxLimits(timeout=5), max_workers=2) as box:
        assert [r.stdout for r in asyncio.run(main(box))] == ["0\n", "2\n", "4\n"]
        assert box.run("print(input())", stdin="hi").stdout == "hi\n"
        assert [r.stdout for r in box.run_many(["print(1)", {"code": "print(2)"}])] == ["1\n", "2\n"]


# -- the reward functions and the tool ----------------------------------------------------------------------------


def test_code_exec_scores_programs_against_expected_output_and_test_cases():
    from workers.reward.functions import resolve_reward_fn

    code_exec = resolve_reward_fn("code_exec")
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    cases = json.dumps([{"stdin": "1 2", "expected": "3"}, {"stdin": "5 5", "expected": "10"},
                        {"stdin": "2 2", "expected": "5"}, {"stdin": "0 0", "expected": "0"}])
    assert code_exec("", program, cases, {}) == 0.75  # the third case's expectation is wrong
    assert code_exec("", "print(6 * 7)", "42", {}) == 1.0
    assert code_exec("", "Sure:\n```python\nprint(41)\n```", "42", {}) == 0.0
    assert code_exec("", "print(42)\nraise SystemExit(1)", "42", {}) == 0.0  # printed it, but failed
    assert code_exec("", "while True: pass", "42", {}, timeout=0.5) == 0.0


def test_the_expression_rewards_run_the_expression_and_compare_its_printed_value():
    from workers.reward.code_exec import expression_of
    from workers.reward.functions import REWARD_FUNCTIONS

    exact, shaped = REWARD_FUNCTIONS["code_expression"], REWARD_FUNCTIONS["code_expression_shaped"]
    for right in ("3*4", "12", "24/2", "12!? (twelve)", "```python\n2*6\n```", "'12'"):
        assert exact("12=", right, "12", {}) == 1.0 and shaped("12=", right, "12", {}) == 1.0, right
    for wrong in ("5", "abc", "", "1/0", "'1,2'"):
        assert exact("12=", wrong, "12", {}) == 0.0, wrong
    assert shaped("12=", "6", "12", {}) == 0.25 and shaped("12=", "abc", "12", {}) == 0.0
    # Only the expression runs: a prefix cannot close print( and smuggle statements in.
    assert expression_of("1)\nimport os\nprint(12") == "1"
    assert exact("12=", "__import__('os').getuid() + 12", str(12 + level_facts(isolation_level()).uid), {}) == 1.0


def test_the_python_tool_returns_the_output_and_reports_errors_as_observations():
    from workers.rollout.agent import PythonTool, ToolBox, ToolCall

    tool = PythonTool(timeout=1.0)
    assert tool.name == "python" and tool.call(code="print(2 ** 10)") == "1024\n"
    assert tool.call(code="x = 1") == "(no output)"
    failed = tool.call(code="print('partial')\n1/0")
    assert failed.startswith("partial\n") and "ZeroDivisionError: division by zero" in failed
    assert failed.endswith("[status: error, exit code 1]")
    with ToolBox([tool], max_observation_chars=200) as box:
        outcome = box.run(ToolCall("python", {"code": "while True: pass"}))
        assert outcome.ok and outcome.content.endswith("[status: timeout (time limit passed), SIGKILL]")
        long = box.run(ToolCall("python", {"code": "print('y' * 5000)"}))
        assert long.ok and long.content.startswith("y" * 100) and "more characters truncated" in long.content


def test_the_code_expression_example_trains_two_steps_through_the_cli(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "controller.cli", "train", "--config", "examples/code_expression.yaml",
         "trainer.total_steps=2", f"trainer.run_dir={run_dir}", "trainer.logger=[jsonl]", "trainer.export_hf=false",
         "trainer.plots=false", "trainer.val_every=2", "data.batch_size=4", "data.val_size=8",
         "ppo.ppo_mini_batch_size=8",
         "actor.engine.micro_batch_size=2", "rollout.sampling.n=2", "rollout.sampling.max_new_tokens=4"],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "critic/score/mean" in s] == [1, 2]
    assert all(0.0 <= s["critic/score/mean"] <= 1.0 for s in steps if "critic/score/mean" in s)
    assert "val/reward/mean" in steps[-1] and "reward code_expression_shaped" in proc.stdout + proc.stderr
