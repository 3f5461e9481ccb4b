"""The ``python`` tool: the model's code runs in the sandbox (``workers.sandbox``), its output is the observation.

::

    tool = PythonTool()                          # SandboxLimits(timeout=5) by default
    tool.call(code="print(sum(range(10)))")      # "45\\n"
    tool.call(code="1/0")                        # "Traceback ... ZeroDivisionError: division by zero
                                                 #  [status: error, exit code 1]"

    rollout:
      agent: {tools: [calculator, python], ...}

The observation is the program's stdout; when the program did not end "ok"
(an exception, a timeout, a limit), stderr follows and a last line gives the
status (``[status: timeout (time limit passed), SIGKILL]``), so the model reads its own error
as it would in a terminal. Every outcome of the program is an observation,
never a tool error; only a sandbox that cannot start at all raises (a
``raised`` tool error for the ToolBox). The text is cut to
``max_output_chars`` with the ToolBox's marker. ``timeout_s``, the
ToolBox's deadline for the call, is the sandbox's timeout plus 5 s, so the
sandbox's own timeout (which kills the program) comes first.
"""

from __future__ import annotations

import signal
from typing import Any

from workers.rollout.agent.tool import Tool, truncate_observation
from workers.sandbox import SandboxLimits, run
from workers.sandbox.result import SANDBOX_ERROR, SandboxResult

__all__ = ["PythonTool"]

_NO_OUTPUT = "(no output)"
_MEANING = {"timeout": "time limit passed", "memory": "memory limit reached", "processes": "process limit reached",
            "output": "output limit passed",
            "file_size": "file size limit reached"}


def _how_it_ended(result: SandboxResult) -> str:
    """``error, exit code 1`` / ``timeout (time limit passed), SIGKILL`` / ``killed, SIGSEGV``."""
    status = result.status + (f" ({_MEANING[result.status]})" if result.status in _MEANING else "")
    if result.signal is not None:
        try:
            return f"{status}, {signal.Signals(result.signal).name}"
        except ValueError:
            return f"{status}, signal {result.signal}"
    return f"{status}, exit code {result.returncode}"


class PythonTool(Tool):
    """Runs a Python program in the sandbox and returns what it printed (module docstring)."""

    name = "python"
    description = ("Run a Python 3 program (standard library only, no network, no files but its own) and return "
                   "what it prints. Print the values you need.")
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete Python program, e.g. print(2**10)"}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, limits: SandboxLimits | None = None, max_output_chars: int = 2000,
                 isolation: str | None = None, **limit_overrides: Any) -> None:
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        self.limits = (limits or SandboxLimits(timeout=5.0)).replace(**limit_overrides)
        if isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int) or max_output_chars < 1:
            raise ValueError(f"max_output_chars must be a positive integer, got {max_output_chars!r}")
        self.max_output_chars = max_output_chars
        self.isolation = isolation
        self.timeout_s = self.limits.timeout + 5.0

    def call(self, code: str) -> str:
        result = run(code, limits=self.limits, isolation=self.isolation)
        if result.status == SANDBOX_ERROR:
            raise RuntimeError(f"the sandbox could not start: {result.stderr.strip()[-500:]}")
        if result.ok:
            return truncate_observation(result.stdout or _NO_OUTPUT, self.max_output_chars)
        parts = [result.stdout.rstrip("\n")] if result.stdout else []
        if result.stderr.strip():
            parts.append(result.stderr.rstrip("\n"))
        # The status line stays when the text is cut: it is what tells the model what happened.
        status = f"[status: {_how_it_ended(result)}]"
        body = "\n".join(parts)
        room = max(self.max_output_chars - len(status) - 1, 0)
        if len(body) > room:
            body = "[...] " + body[len(body) - room + 6:] if room > 6 else ""
        return f"{body}\n{status}" if body else status
