"""Agentic rollouts: tools and the ToolBox that runs them under timeouts, tool-call parsing, token-exact
trajectories, and the AgentLoop that runs each sample as a conversation on the rollout engine.

::

    from workers.rollout.agent import Calculator, ToolBox, parse_tool_calls

    with ToolBox([Calculator()]) as box:
        reply = parse_tool_calls(text, "hermes")         # or "json", or "vllm:<parser>"
        if reply.has_tool_calls:
            observations = [outcome.message() for outcome in box.run_reply(reply)]
        else:
            answer = reply.content
"""

from workers.rollout.agent.calculator import Calculator, evaluate, format_number
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
    "BAD_ARGUMENTS", "Calculator", "MALFORMED", "ParsedReply", "RAISED", "TIMEOUT", "TOOL_ERROR_KINDS", "TOOL_FORMATS",
    "Tool", "ToolBox", "ToolCall", "ToolOutcome", "UNKNOWN_TOOL", "error_counts", "evaluate", "format_number",
    "parse_tool_calls", "truncate_observation",
]
