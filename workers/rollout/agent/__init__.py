"""Agentic rollouts: tools and the ToolBox that runs them under timeouts, tool-call parsing, token-exact
trajectories, and the AgentLoop that runs each sample as a conversation on the rollout engine.

Two tools ship: ``Calculator`` (exact arithmetic on a parsed expression, never ``eval``) and
``PythonTool`` (named "python": the model's program runs in the sandbox, ``workers.sandbox``, and what it
prints is the observation).

::

    from workers.rollout.agent import Calculator, PythonTool, ToolBox, parse_tool_calls

    with ToolBox([Calculator(), PythonTool()]) as box:
        reply = parse_tool_calls(text, "hermes")         # or "json", or "vllm:<parser>"
        if reply.has_tool_calls:
            observations = [outcome.message() for outcome in box.run_reply(reply)]
        else:
            answer = reply.content
"""

from workers.rollout.agent.calculator import Calculator, evaluate, format_number
from workers.rollout.agent.python_tool import PythonTool
from workers.rollout.agent.tool import (
    BAD_ARGUMENTS,
    MALFORMED,
    RAISED,
    TIMEOUT,
    TOOL_ERROR_KINDS,
    UNKNOWN_TOOL,
    Tool,
    ToolBox,
    ToolCall,
    ToolOutcome,
    error_counts,
    truncate_observation,
)
from workers.rollout.agent.loop import (
    FINISH_REASONS,
    AgentLimits,
    AgentLoop,
    AgentResult,
    Environment,
    StepResult,
    ToolEnvironment,
    agent_metrics,
)
from workers.rollout.agent.tool_calls import TOOL_FORMATS, ParsedReply, parse_tool_calls
from workers.rollout.agent.trajectory import ChatFormat, ChatTemplateError, Trajectory

__all__ = [
    "AgentLimits", "AgentLoop", "AgentResult", "ChatFormat", "ChatTemplateError", "Environment", "FINISH_REASONS",
    "StepResult", "ToolEnvironment", "Trajectory", "agent_metrics",
    "BAD_ARGUMENTS", "Calculator", "MALFORMED", "ParsedReply", "PythonTool", "RAISED", "TIMEOUT", "TOOL_ERROR_KINDS",
    "TOOL_FORMATS", "Tool", "ToolBox", "ToolCall", "ToolOutcome", "UNKNOWN_TOOL", "error_counts", "evaluate",
    "format_number", "parse_tool_calls", "truncate_observation",
]
