"""Tool calls read out of a model's reply text, in the chat template's tool-call format; syntax only.

::

    reply = parse_tool_calls(text, "hermes")
    reply.content            # the text with the tool-call blocks removed (the final answer is read from it)
    reply.calls              # [ToolCall(name="calculator", arguments={"expression": "2*3"}, raw="<tool_call>...")]
    reply.errors             # [ToolOutcome(error="malformed", content="error: malformed tool call: ...")]
    outcomes = toolbox.run_reply(reply)    # the calls run, the errors in place: one observation per block

A block that does not parse is an error outcome (kind ``malformed``, with an
observation that says what is wrong and what was expected), never an
exception, and the other blocks of the reply still count. Whether the named
tool exists and the arguments fit its schema is checked by ``ToolBox.run``
(``unknown_tool``, ``bad_arguments``), not here.

Formats (``tool_format``):

``"hermes"``
    What the Hermes 2 Pro, Qwen2.5 and Qwen3 chat templates teach and render::

        <tool_call>
        {"name": "calculator", "arguments": {"expression": "2*3"}}
        </tool_call>

    any number of blocks anywhere in the reply. The body between the tags is
    one JSON object with a non-empty string ``"name"`` and an object
    ``"arguments"`` (given as a JSON string holding an object, as Hermes
    models sometimes write it, it is decoded; left out, it is ``{}``). Errors:
    a ``<tool_call>`` with no ``</tool_call>`` after it (the rest of the reply
    is the bad block), a body that is not JSON or not an object, no name,
    arguments that are not an object.

``"json"``
    The project's fallback for templates without a tool format (SmolLM2's, for
    one): simple enough for a tiny model to learn from a system prompt. A call
    is a JSON object with a string ``"tool"`` and an object ``"arguments"``::

        {"tool": "calculator", "arguments": {"expression": "2*3"}}

    written either on a line of its own (the line, stripped of surrounding
    spaces, starts with ``{``), or as the whole body of a fenced code block
    opened by a line ```` ```json ```` (or a bare ```` ``` ````) and closed by a
    line ```` ``` ````; the body is one object, over any number of lines. Such a
    line or body is taken for a call when it contains the text ``"tool"``; one
    that then fails to parse is a ``malformed`` error, and everything else
    (other lines, other JSON, code blocks in other languages) is content. As
    for "hermes", arguments may be a JSON string holding the object, or left
    out. A fence opened and never closed with ``"tool"`` after it is an error.

``"vllm:<parser>"``
    vLLM's own tool parser of that ``--tool-call-parser`` name (``vllm:hermes``,
    ``vllm:llama3_json``, ``vllm:mistral``, ...), for formats not written here;
    needs ``tokenizer`` (the model's HF tokenizer) and imports vLLM (seconds).
    Its parsers are all-or-nothing and silent about bad calls: a reply with
    one malformed block reads as a plain answer, with no calls and no error
    (and vLLM logs the exception); their ``content`` is what vLLM's server
    would return (for hermes: the text before the first call), and ``raw``
    is the call re-serialized, since they do not report where it was.

Why "hermes" is not vLLM's ``Hermes2ProToolParser``: it can be built offline
(``ToolParserManager.get_tool_parser("hermes")(tokenizer)`` with any HF
tokenizer and a ``ChatCompletionRequest(messages=[], model=...)``, no server
or GPU) and tests/rollout/test_agent_tools.py checks that it finds the same
calls as this parser on well-formed replies. But for training it loses what
the agent loop needs: one bad block drops every call of the reply without
saying why (no error to return to the model, nothing to count), it keeps an
arguments string as a double-encoded string, its content drops any text after
the first call, and it accepts an unterminated last block. It also costs a
vLLM import, which the megatron rollout engine does not otherwise need.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from workers.rollout.agent.tool_outcome import MALFORMED, ToolCall, ToolOutcome

__all__ = ["HERMES_END", "HERMES_START", "ParsedReply", "TOOL_FORMATS", "parse_tool_calls"]

TOOL_FORMATS = ("hermes", "json")  # and "vllm:<parser name>"
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
HERMES_EXPECTED = '<tool_call>\n{"name": <tool name>, "arguments": {<arguments>}}\n</tool_call>'
JSON_EXPECTED = '{"tool": <tool name>, "arguments": {<arguments>}} on a line of its own'
VLLM_PREFIX = "vllm:"
_FENCE = re.compile(r"^```[ \t]*([A-Za-z0-9_+.-]*)[ \t]*$")
_RAW_SHOWN = 120  # characters of a bad block quoted in its error observation


@dataclass
class ParsedReply:
    """A reply split into its text and its tool-call blocks (in reply order: ``ToolCall`` or error ``ToolOutcome``)."""

    content: str
    blocks: list[ToolCall | ToolOutcome] = field(default_factory=list)

    @property
    def calls(self) -> list[ToolCall]:
        return [block for block in self.blocks if isinstance(block, ToolCall)]

    @property
    def errors(self) -> list[ToolOutcome]:
        return [block for block in self.blocks if isinstance(block, ToolOutcome)]

    @property
    def has_tool_calls(self) -> bool:
        """Whether the reply tried to call a tool (well-formed or not): if not, it is the final answer."""
        return bool(self.blocks)


def parse_tool_calls(text: str, tool_format: str = "hermes", tokenizer: Any = None) -> ParsedReply:
    """The tool calls in ``text`` (a decoded reply) in ``tool_format``; bad blocks become errors, not exceptions.

    ``tokenizer`` is only used (and needed) by the ``vllm:<parser>`` formats.
    """
    if tool_format == "hermes":
        return _parse_hermes(text)
    if tool_format == "json":
        return _parse_json_lines(text)
    if isinstance(tool_format, str) and tool_format.startswith(VLLM_PREFIX):
        return _parse_vllm(text, tool_format[len(VLLM_PREFIX):], tokenizer)
    raise ValueError(f"tool_format {tool_format!r} is not one of {TOOL_FORMATS} or 'vllm:<parser name>'")


def _malformed(problem: str, raw: str, expected: str) -> ToolOutcome:
    shown = raw if len(raw) <= _RAW_SHOWN else raw[:_RAW_SHOWN] + "..."
    return ToolOutcome(None, f"error: malformed tool call: {problem} in {shown!r}; expected {expected}", False,
                       MALFORMED)


def _arguments(value: Any) -> dict[str, Any] | str:
    """The arguments object, or what is wrong with it (a str)."""
    if isinstance(value, str):  # '"arguments": "{\"x\": 1}"': Hermes models write this now and then
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return "arguments must be a JSON object, got a string that is not JSON"
        if isinstance(decoded, dict):
            return decoded
        return f"arguments must be a JSON object, got a string holding {_json_type(decoded)}"
    if isinstance(value, dict):
        return value
    return f"arguments must be a JSON object, got {_json_type(value)}"


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _decode(body: str, raw: str, name_key: str, expected: str) -> ToolCall | ToolOutcome:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return _malformed(f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})", raw, expected)
    if not isinstance(obj, dict):
        return _malformed(f"the call must be a JSON object, got {_json_type(obj)}", raw, expected)
    name = obj.get(name_key)
    if not isinstance(name, str) or not name.strip():
        return _malformed(f'no tool name (a non-empty string "{name_key}")', raw, expected)
    arguments = _arguments(obj.get("arguments", {}))
    if isinstance(arguments, str):
        return _malformed(arguments, raw, expected)
    return ToolCall(name.strip(), arguments, raw)


def _parse_hermes(text: str) -> ParsedReply:
    pieces: list[str] = []
    blocks: list[ToolCall | ToolOutcome] = []
    position = 0
    while True:
        start = text.find(HERMES_START, position)
        if start < 0:
            pieces.append(text[position:])
            break
        pieces.append(text[position:start])
        body_start = start + len(HERMES_START)
        end = text.find(HERMES_END, body_start)
        if end < 0:
            blocks.append(_malformed(f"{HERMES_START} is never closed by {HERMES_END}", text[start:],
                                     HERMES_EXPECTED))
            break
        position = end + len(HERMES_END)
        blocks.append(_decode(text[body_start:end], text[start:position], "name", HERMES_EXPECTED))
    return ParsedReply("".join(pieces).strip(), blocks)


def _parse_json_lines(text: str) -> ParsedReply:
    lines = text.splitlines(keepends=True)
    pieces: list[str] = []
    blocks: list[ToolCall | ToolOutcome] = []
    i = 0
    while i < len(lines):
        line, stripped = lines[i], lines[i].strip()
        fence = _FENCE.match(stripped)
        if fence:
            close = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            candidate = fence.group(1).lower() in ("", "json")
            if close is None:
                rest = "".join(lines[i:])
                if candidate and '"tool"' in rest:
                    blocks.append(_malformed("a ``` block is never closed", rest.strip(), JSON_EXPECTED))
                    break
                pieces.append(line)
                i += 1
                continue
            raw = "".join(lines[i:close + 1])
            body = "".join(lines[i + 1:close])
            if candidate and '"tool"' in body:
                blocks.append(_decode(body, raw.strip(), "tool", JSON_EXPECTED))
            else:
                pieces.append(raw)
            i = close + 1
            continue
        if stripped.startswith("{") and '"tool"' in stripped:
            blocks.append(_decode(stripped, stripped, "tool", JSON_EXPECTED))
        else:
            pieces.append(line)
        i += 1
    return ParsedReply("".join(pieces).strip(), blocks)


def _parse_vllm(text: str, parser_name: str, tokenizer: Any) -> ParsedReply:
    if tokenizer is None:
        raise ValueError(f"tool_format 'vllm:{parser_name}' needs the model's tokenizer (tokenizer=...)")
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager
    except ImportError as exc:
        raise ImportError(f"tool_format 'vllm:{parser_name}' needs vLLM's tool parsers: {exc}") from exc
    try:
        parser_class = ToolParserManager.get_tool_parser(parser_name)
    except KeyError:
        known = sorted(ToolParserManager.list_registered())
        raise ValueError(f"vLLM has no tool parser {parser_name!r}; it has {known}") from None
    parser = parser_class(tokenizer)  # non-streaming extraction keeps no state: a fresh one is cheap
    info = parser.extract_tool_calls(text, ChatCompletionRequest(messages=[], model="hybridflow"))
    blocks: list[ToolCall | ToolOutcome] = []
    expected = f"the vllm:{parser_name} tool-call format"
    for call in info.tool_calls if info.tools_called else []:
        try:  # a JSON string; it holds a string again where the model wrote the arguments as one
            arguments = json.loads(call.function.arguments)
        except (TypeError, json.JSONDecodeError):
            arguments = call.function.arguments
        raw = json.dumps({"name": call.function.name, "arguments": arguments}, ensure_ascii=False)
        blocks.append(_decode(raw, raw, "name", expected))
    content = text if not info.tools_called else (info.content or "")
    return ParsedReply(content.strip(), blocks)
