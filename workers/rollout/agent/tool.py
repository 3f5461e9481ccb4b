"""Tools an agentic rollout can call, and the ToolBox that runs them safely under a timeout.

A user's tool is a plain class: a name, a description, a JSON schema of its
arguments, and ``call(**arguments) -> str``::

    class Lookup(Tool):
        name = "lookup"
        description = "The capital of a country."
        parameters = {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}
        timeout_s = 2.0

        def call(self, country: str) -> str:
            return CAPITALS.get(country, "unknown")

    with ToolBox([Calculator(), Lookup()]) as box:
        tokenizer.apply_chat_template(messages, tools=box.schemas(), ...)
        outcome = box.run(ToolCall("calculator", {"expression": "2*(3+4)"}))
        outcome.ok, outcome.content                             # (True, "14")
        outcomes = box.run_many(calls)                          # concurrently, in the calls' order
        outcomes = box.run_reply(parse_tool_calls(text, "hermes"))  # one per block, parse errors included

``ToolBox.run`` never raises for anything a tool or the model did wrong:
an unknown name, arguments that fail the schema, a tool that raises or
overruns its timeout all come back as a ``ToolOutcome`` with ``ok=False``,
``error`` one of ``TOOL_ERROR_KINDS`` and ``content`` the error observation
the model reads next (e.g. ``error: tool 'calculator' timed out after 2 s``).
The agent loop counts them per kind (``error_counts``, metric
``agent/tool_errors``).

Threads and timeouts (``workers.deadline_threads``): each call runs on a daemon thread of its own, at most
``max_threads`` at once, and is waited for with ``future.result(timeout)``
(daemon threads: a tool that never returns does not hold its process at exit). A Python
call cannot be killed: one that overruns keeps its thread until it returns
by itself. So that hung tools cannot block the rollout, a call that finds
every thread held by such an overrun call is not queued: it comes back at
once as a ``timeout`` error. A tool's ``call`` may run on several threads at
once (``run_many``, or several agent loops sharing a ToolBox): it must be
thread-safe. ``ToolBox`` itself may be used from several threads.

Two tools ship: ``Calculator`` (workers.rollout.agent.calculator) and
``PythonTool`` ("python", workers.rollout.agent.python_tool), whose code runs
in the sandbox (workers.sandbox), never in the rollout's process. No shell or
network tool ships.
"""

from __future__ import annotations

import inspect
import math
import re
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from workers.deadline_threads import DeadlineThreads
from workers.rollout.agent.tool_outcome import (  # noqa: F401 (re-exported: the tool's public names)
    BAD_ARGUMENTS,
    MALFORMED,
    RAISED,
    TIMEOUT,
    TOOL_ERROR_KINDS,
    UNKNOWN_TOOL,
    ToolCall,
    ToolOutcome,
    error_counts,
)

if TYPE_CHECKING:
    from workers.rollout.agent.tool_calls import ParsedReply

__all__ = [
    "BAD_ARGUMENTS", "MALFORMED", "RAISED", "TIMEOUT", "TOOL_ERROR_KINDS", "TOOL_NAME_PATTERN", "UNKNOWN_TOOL",
    "Tool", "ToolBox", "ToolCall", "ToolOutcome", "error_counts", "truncate_observation",
]

# OpenAI's rule for function names, which chat templates and vLLM's parsers assume.
TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TRUNCATION_MARKER = "\n[... {n} more characters truncated]"


class Tool:
    """A tool the model can call: subclass it, set the class attributes and write ``call``.

    ``parameters`` is a JSON schema of the arguments object
    (``{"type": "object", "properties": {...}, "required": [...]}``); the
    ToolBox validates every call against it before ``call`` runs, so ``call``
    receives the arguments as keyword arguments of the declared types.
    ``call`` returns the observation text; raising (any exception) turns into
    an error observation with the exception's message.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    timeout_s: float = 5.0

    def call(self, **arguments: Any) -> str:
        raise NotImplementedError(f"{type(self).__name__} must implement call(**arguments) -> str")

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function spec that HF chat templates take in ``apply_chat_template(tools=[...])``."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def truncate_observation(text: str, max_chars: int) -> str:
    """``text`` cut to its first ``max_chars`` characters, with a marker saying how many were dropped."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + TRUNCATION_MARKER.format(n=len(text) - max_chars)


def _format_seconds(seconds: float) -> str:
    return f"{seconds:g} s"


def _check_tool(tool: Any) -> list[str]:
    """What is wrong with ``tool`` as a ToolBox entry (empty: nothing)."""
    if not isinstance(tool, Tool):
        return [f"{tool!r} is not a Tool (subclass workers.rollout.agent.Tool)"]
    problems = []
    label = f"tool {type(tool).__name__}"
    if not isinstance(tool.name, str) or not TOOL_NAME_PATTERN.match(tool.name):
        problems.append(f"{label}: name {tool.name!r} must be 1-64 characters of letters, digits, '_' or '-'")
    else:
        label = f"tool {tool.name!r}"
    if not isinstance(tool.description, str):
        problems.append(f"{label}: description must be a str, got {type(tool.description).__name__}")
    timeout = tool.timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        problems.append(f"{label}: timeout_s must be a positive number of seconds, got {timeout!r}")
    parameters = tool.parameters
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        problems.append(f"{label}: parameters must be a JSON schema of an object ({{'type': 'object', "
                        f"'properties': ...}}), got {parameters!r}")
    else:
        import jsonschema

        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as exc:
            problems.append(f"{label}: parameters is not a valid JSON schema: {exc.message}")
    if type(tool).call is Tool.call:
        problems.append(f"{label}: {type(tool).__name__} does not implement call(**arguments) -> str")
    return problems


@dataclass
class _Entry:
    tool: Tool
    validator: Any
    signature: inspect.Signature | None


@dataclass
class _Pending:
    """A call submitted to the pool (or refused before it could be)."""

    call: ToolCall
    entry: _Entry | None = None
    future: Future | None = None
    deadline: float = 0.0
    outcome: ToolOutcome | None = None  # set when decided without waiting on the future
    timing: list[float] = field(default_factory=list)  # [start, end] written by the worker thread


class ToolBox:
    """The tools of an agentic rollout, by name, and the bounded set of threads that runs their calls.

    ``max_threads`` bounds the calls running at once; ``max_observation_chars``
    truncates every observation (results and error texts) with a marker.
    Refuses, at construction, anything that is not a Tool, duplicate or
    invalid names, bad timeouts and parameter schemas that are not valid JSON
    schemas of an object.
    """

    def __init__(self, tools: Iterable[Tool], max_threads: int = 8, max_observation_chars: int = 2000) -> None:
        import jsonschema

        tools = list(tools)
        problems = [problem for tool in tools for problem in _check_tool(tool)]
        names = [tool.name for tool in tools if isinstance(tool, Tool)]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            problems.append(f"duplicate tool names {duplicates}: each tool needs its own name")
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            problems.append(f"max_threads must be a positive integer, got {max_threads!r}")
        if isinstance(max_observation_chars, bool) or not isinstance(max_observation_chars, int) \
                or max_observation_chars < 1:
            problems.append(f"max_observation_chars must be a positive integer, got {max_observation_chars!r}")
        if problems:
            raise ValueError("invalid ToolBox: " + "; ".join(problems))
        self._entries: dict[str, _Entry] = {}
        for tool in tools:
            validator = jsonschema.validators.validator_for(tool.parameters)(tool.parameters)
            try:
                signature = inspect.signature(tool.call)
            except (TypeError, ValueError):  # a builtin or C callable: skip the binding check
                signature = None
            self._entries[tool.name] = _Entry(tool, validator, signature)
        self.max_threads = max_threads
        self.max_observation_chars = max_observation_chars
        self._threads = DeadlineThreads(max_threads, "hybridflow-tool")

    # -- lookup ----------------------------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> Tool:
        return self._entries[name].tool

    def __len__(self) -> int:
        return len(self._entries)

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool's function spec, for ``apply_chat_template(..., tools=box.schemas())``."""
        return [entry.tool.schema() for entry in self._entries.values()]

    @property
    def hung_threads(self) -> int:
        """Threads still held by calls that overran their timeout (they return when the call does)."""
        return self._threads.hung

    # -- running ---------------------------------------------------------------------------------------------------

    def run(self, call: ToolCall) -> ToolOutcome:
        """Run one call under its tool's timeout; every failure is an error outcome, never an exception."""
        return self.run_many([call])[0]

    def run_many(self, calls: Iterable[ToolCall]) -> list[ToolOutcome]:
        """Run several calls concurrently (a slow tool does not hold up the others); outcomes in the calls' order."""
        pending = [self._submit(call) for call in calls]
        return [self._collect(item) for item in pending]

    def run_reply(self, reply: "ParsedReply") -> list[ToolOutcome]:
        """One outcome per tool-call block of a parsed reply, in reply order: its calls run, its parse errors kept."""
        blocks = reply.blocks
        ran = iter(self.run_many([block for block in blocks if isinstance(block, ToolCall)]))
        return [next(ran) if isinstance(block, ToolCall) else block for block in blocks]

    def close(self) -> None:
        """Refuse new calls; threads held by running calls end when those return (they never hold the process)."""
        self._threads.close()

    def __enter__(self) -> "ToolBox":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ToolBox({self.names}, max_threads={self.max_threads})"

    # -- internals -------------------------------------------------------------------------------------------------

    def _error(self, call: ToolCall | None, kind: str, text: str, seconds: float = 0.0) -> ToolOutcome:
        return ToolOutcome(call, truncate_observation(f"error: {text}", self.max_observation_chars), False, kind,
                           seconds)

    def _check_call(self, call: ToolCall) -> tuple[_Entry | None, ToolOutcome | None]:
        entry = self._entries.get(call.name) if isinstance(call.name, str) else None
        if entry is None:
            return None, self._error(call, UNKNOWN_TOOL, f"unknown tool {call.name!r}; the tools are {self.names}")
        if not isinstance(call.arguments, dict):
            return None, self._error(call, BAD_ARGUMENTS, f"arguments of tool {call.name!r} must be a JSON object, "
                                                          f"got {type(call.arguments).__name__}")
        import jsonschema

        problem = jsonschema.exceptions.best_match(entry.validator.iter_errors(call.arguments))
        if problem is not None:
            where = "/".join(str(part) for part in problem.absolute_path)
            return None, self._error(call, BAD_ARGUMENTS, f"bad arguments for tool {call.name!r}"
                                                          f"{f' at {where!r}' if where else ''}: {problem.message}")
        if entry.signature is not None:
            try:
                entry.signature.bind(**call.arguments)
            except TypeError as exc:
                return None, self._error(call, BAD_ARGUMENTS, f"bad arguments for tool {call.name!r}: {exc}")
        return entry, None

    @staticmethod
    def _invoke(tool: Tool, arguments: dict[str, Any], timing: list[float]) -> Any:
        timing.append(time.monotonic())
        try:
            return tool.call(**arguments)
        finally:
            timing.append(time.monotonic())

    def _submit(self, call: ToolCall) -> _Pending:
        item = _Pending(call)
        item.entry, item.outcome = self._check_call(call)
        if item.outcome is not None:
            return item
        tool = item.entry.tool
        item.deadline = time.monotonic() + tool.timeout_s
        item.future = self._threads.submit(self._invoke, tool, dict(call.arguments), item.timing,
                                           timeout_s=tool.timeout_s)
        if item.future is None:
            item.outcome = self._error(call, TIMEOUT, f"tool {tool.name!r} timed out: it was not started because "
                                                      f"all {self.max_threads} tool threads are still held by "
                                                      f"earlier calls that timed out")
        return item

    def _collect(self, item: _Pending) -> ToolOutcome:
        if item.outcome is not None:
            return item.outcome
        call, tool = item.call, item.entry.tool
        timed_out = self._error(call, TIMEOUT, f"tool {tool.name!r} timed out after {_format_seconds(tool.timeout_s)}",
                                tool.timeout_s)
        try:
            result = item.future.result(timeout=max(0.0, item.deadline - time.monotonic()))
        except FutureTimeout:
            return timed_out
        except (Exception, SystemExit) as exc:  # the tool raised (or called sys.exit); KeyboardInterrupt propagates
            message = str(exc) or type(exc).__name__
            return self._error(call, RAISED, f"tool {tool.name!r} failed: {type(exc).__name__}: {message}",
                               self._seconds(item))
        seconds = self._seconds(item)
        if seconds > tool.timeout_s:  # finished, but after its deadline (seen late): a timeout all the same
            return timed_out
        if not isinstance(result, str):
            return self._error(call, RAISED, f"tool {tool.name!r} returned {type(result).__name__}, not str",
                               seconds)
        return ToolOutcome(call, truncate_observation(result, self.max_observation_chars), True, None, seconds)

    @staticmethod
    def _seconds(item: _Pending) -> float:
        return item.timing[1] - item.timing[0] if len(item.timing) == 2 else 0.0
