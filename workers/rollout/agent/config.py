"""``rollout.agent``: a multi-turn rollout's tools, environment and limits, as the training config gives them.

    rollout:
      agent:
        tools: [calculator, python, my_package.tools:Lookup]   # built-in names or "package.module:Class"
        environment: null        # null: the tools answer; or "package.module:Class" (an Environment)
        tool_format: hermes      # hermes (Hermes / Qwen <tool_call>), json, or vllm:<parser>
        max_turns: 4
        max_response_length: 256
        entrypoint: null         # or "package.module:agent": the user's own agent, on rollout.server

Everything is resolved and checked when the config is built, before any
worker starts: an unknown built-in, an import path that does not import, a
class that is no Tool (or Environment) is an error naming it and what is
valid. A tool runs inside the rollout worker's process, with its rights:
write and install only tools you trust. The built-in ``python`` tool runs
the model's code in the sandbox (``sandbox.isolation``), not there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from workers.import_path import import_object
from workers.rollout.agent.calculator import Calculator
from workers.rollout.agent.loop import AgentLimits, Environment, ToolEnvironment
from workers.rollout.agent.python_tool import PythonTool
from workers.rollout.agent.tool import Tool, ToolBox
from workers.rollout.agent.tool_calls import TOOL_FORMATS

__all__ = ["AgentConfig", "BUILTIN_TOOLS", "resolve_tool", "resolve_environment"]

BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": Calculator, "python": PythonTool}


def resolve_tool(name: str) -> type[Tool]:
    """A tool class from a built-in name (``BUILTIN_TOOLS``) or ``package.module:Class``."""
    if name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[name]
    if ":" not in name:
        raise ValueError(f"unknown tool {name!r}; built-in tools: {sorted(BUILTIN_TOOLS)}, or give an import path "
                         "'package.module:Class'")
    cls = import_object(name, "tool")
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"tool {name!r} is {cls!r}, not a subclass of workers.rollout.agent.Tool")
    return cls


def resolve_environment(path: str) -> type[Environment]:
    cls = import_object(path, "environment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {path!r} is {cls!r}, not a subclass of workers.rollout.agent.Environment")
    return cls


@dataclass(frozen=True)
class AgentConfig:
    """A multi-turn rollout's tools, environment and limits."""

    tools: tuple[str, ...] = ("calculator",)  # built-in tool names (BUILTIN_TOOLS) or "package.module:Class"
    environment: str | None = None  # None: ToolEnvironment over the tools
    # how replies call tools: "hermes" (<tool_call> tags: Hermes, Qwen), "json", or "vllm:<parser>"
    tool_format: str = "hermes"
    max_turns: int = 4  # model turns per sample at most
    max_response_length: int = 256  # tokens after the prompt, model turns and observations together
    max_concurrent_steps: int = 16  # environment steps (tool calls) running at once
    max_observation_chars: int = 2000  # each tool result or error text cut to this many characters
    # The user's agent as the environment (needs rollout.server): "package.module:function", an
    # ``async def agent(client, row) -> float | None`` run once per sample with an openai.AsyncOpenAI client on
    # the rollout server (controller.serving.user_agents); tools and environment above are then unused.
    entrypoint: str | None = None
    max_concurrent_sessions: int = 64  # agent samples running at once
    session_timeout_s: float = 300.0  # an agent sample that takes longer ends (counted: agent/timeout)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        problems = []
        for name in self.tools:
            try:
                resolve_tool(name)
            except ValueError as exc:
                problems.append(str(exc))
        if len(set(self.tools)) != len(self.tools):
            problems.append(f"tools lists a tool twice: {list(self.tools)}")
        if self.environment is not None:
            try:
                resolve_environment(self.environment)
            except ValueError as exc:
                problems.append(str(exc))
        if self.tool_format not in TOOL_FORMATS and not self.tool_format.startswith("vllm:"):
            problems.append(f"tool_format {self.tool_format!r} is not one of {TOOL_FORMATS} or 'vllm:<parser>'")
        try:
            self.limits()
        except ValueError as exc:
            problems.append(str(exc))
        if self.entrypoint is not None and (not isinstance(self.entrypoint, str) or ":" not in self.entrypoint):
            problems.append(f"entrypoint {self.entrypoint!r} is not an import path 'package.module:function'")
        if not isinstance(self.max_concurrent_sessions, int) or self.max_concurrent_sessions < 1:
            problems.append(f"max_concurrent_sessions must be a positive integer, got {self.max_concurrent_sessions!r}")
        if not isinstance(self.session_timeout_s, (int, float)) or not self.session_timeout_s > 0:
            problems.append(f"session_timeout_s must be a positive number of seconds, got {self.session_timeout_s!r}")
        if not isinstance(self.max_observation_chars, int) or self.max_observation_chars < 1:
            problems.append(f"max_observation_chars must be a positive integer, got {self.max_observation_chars!r}")
        if problems:
            raise ValueError("invalid rollout.agent config: " + "; ".join(problems))

    def limits(self) -> AgentLimits:
        return AgentLimits(self.max_turns, self.max_response_length, self.max_concurrent_steps)

    def toolbox(self) -> ToolBox:
        return ToolBox([resolve_tool(name)() for name in self.tools], max_observation_chars=self.max_observation_chars)

    def environment_factory(self, box: ToolBox, tokenizer=None) -> Callable[[dict], Environment]:
        """sample -> a fresh Environment for it (``reset(sample)`` then gives it the sample).

        The configured class is built with no arguments, or, for a ToolEnvironment subclass, with the
        ToolBox, the tool format and the tokenizer; no class configured: the tools answer.
        """
        cls = resolve_environment(self.environment) if self.environment is not None else ToolEnvironment
        if issubclass(cls, ToolEnvironment):
            return lambda sample: cls(box, self.tool_format, tokenizer)
        return lambda sample: cls()
