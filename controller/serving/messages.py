"""OpenAI chat messages as the server compares and returns them.

A client sends the whole conversation with every request; the server decides whether it extends what the
session was served by comparing messages, not text: ``normalized`` keeps what a chat template renders (role,
text content, tool calls with their arguments as parsed JSON, the tool call a result answers) and drops what
clients add on their own (``refusal: null``, ``annotations``, a tool call's id, ...).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["assistant_message", "normalized", "template_messages", "tool_call_json"]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones, joined
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def normalized(message: dict) -> tuple:
    """What of ``message`` a chat template renders, comparable across clients."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"a chat message is an object with a 'role', got {message!r}")
    calls = tuple((call.get("function", {}).get("name"),
                   json.dumps(_arguments(call.get("function", {}).get("arguments")), sort_keys=True))
                  for call in message.get("tool_calls") or ())
    return (message["role"], _text(message.get("content")), calls, message.get("name"))


def template_messages(messages: list[dict]) -> list[dict]:
    """``messages`` as HF chat templates take them: text content, tool-call arguments as objects."""
    out = []
    for message in messages:
        item = {"role": message["role"], "content": _text(message.get("content"))}
        if message.get("tool_calls"):
            item["tool_calls"] = [{"type": "function", "function": {
                "name": call["function"]["name"], "arguments": _arguments(call["function"].get("arguments"))}}
                for call in message["tool_calls"]]
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                item[key] = message[key]
        out.append(item)
    return out


def tool_call_json(name: str, arguments: dict, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def assistant_message(content: str, tool_calls: list[dict]) -> dict:
    """The assistant message a chat completion returns (and the client sends back)."""
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message
