"""A tool call the model made, and what it produced: the data a ToolBox runs and the parser builds.

``ToolCall`` (name, arguments, the text it came from) and ``ToolOutcome`` (the observation, ok or one
of ``TOOL_ERROR_KINDS``), shared by ``tool`` (which runs calls) and ``tool_calls`` (which parses them
from a reply), so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["BAD_ARGUMENTS", "MALFORMED", "RAISED", "TIMEOUT", "TOOL_ERROR_KINDS", "UNKNOWN_TOOL", "ToolCall",
           "ToolOutcome", "error_counts"]

# What went wrong with a tool call (ToolOutcome.error), counted per kind in `agent/tool_errors`.
MALFORMED = "malformed"  # the reply's tool-call text does not parse (tool_calls.parse_tool_calls)
UNKNOWN_TOOL = "unknown_tool"  # a well-formed call names no tool of the ToolBox
BAD_ARGUMENTS = "bad_arguments"  # the arguments fail the tool's JSON schema or its call signature
RAISED = "raised"  # the tool raised, or returned something other than a str
TIMEOUT = "timeout"  # the tool overran its timeout_s, or no thread was free (all held by overrun calls)
TOOL_ERROR_KINDS = (MALFORMED, UNKNOWN_TOOL, BAD_ARGUMENTS, RAISED, TIMEOUT)


@dataclass
class ToolCall:
    """One call the model made: the tool's name, its arguments, and the reply text it was parsed from."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""


@dataclass
class ToolOutcome:
    """What one call produced: ``content`` is the observation the model reads (the result or the error text).

    ``call`` is None for a tool-call block that did not parse; ``error`` is
    None when ``ok``, else one of ``TOOL_ERROR_KINDS``; ``seconds`` is the
    time the tool ran (0 when it did not run).
    """

    call: ToolCall | None
    content: str
    ok: bool
    error: str | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.ok != (self.error is None):
            raise ValueError(f"ToolOutcome ok={self.ok} needs error=None, and ok=False an error kind; "
                             f"got {self.error!r}")
        if self.error is not None and self.error not in TOOL_ERROR_KINDS:
            raise ValueError(f"ToolOutcome error {self.error!r} is not one of {TOOL_ERROR_KINDS}")

    def message(self) -> dict[str, Any]:
        """The chat message that hands this outcome to the model (``role: tool``)."""
        message: dict[str, Any] = {"role": "tool", "content": self.content}
        if self.call is not None:
            message["name"] = self.call.name
        return message


def error_counts(outcomes: Iterable[ToolOutcome]) -> dict[str, int]:
    """How many outcomes failed, per kind (every kind present, zeros included)."""
    counts = dict.fromkeys(TOOL_ERROR_KINDS, 0)
    for outcome in outcomes:
        if outcome.error is not None:
            counts[outcome.error] += 1
    return counts
