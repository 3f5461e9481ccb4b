"""Token-exact multi-turn trajectories: the ids the engine generated, and the observations between them.

A trajectory is never rebuilt from text. Its token ids are the prompt (the
chat template applied to the first messages), then, turn by turn, exactly
the ids the engine sampled (``response_mask`` 1, with their rollout
log-probs) and the ids of what the tools or the environment answered,
framed by the chat template's own delimiters (``response_mask`` 0)::

    chat = ChatFormat(tokenizer, tools=box.schemas())
    trajectory = Trajectory(chat.prompt_ids(messages))
    trajectory.add_model_turn(completion.token_ids, completion.log_probs)
    trajectory.add_observation(chat.observation_ids([{"role": "tool", "content": "14"}],
                                                    closed=completion.token_ids[-1:] == [chat.end_of_turn_id]))

Decoding the generated ids and tokenizing the text again would not, in
general, give them back (a BPE merge across a turn's edge, text that reads
as a special token, a template that strips whitespace): that drift is how
the trainer comes to score tokens the model never sampled.

Tools reach the model through the template (``apply_chat_template(tools=...)``)
when it renders them; a template that ignores them (SmolLM2's, plain ChatML)
gets them as a system message instead: what a call looks like in the
configured format, and the tools' JSON schemas.

``ChatFormat.observation_ids`` learns the template's framing by rendering it:
a fixed conversation, then the same conversation with the new messages and
the next assistant header. The ids after the common prefix are the new
messages in the template's own delimiters; the ids the template puts after
an assistant turn's end-of-turn token (ChatML's newline) come first, and
the end-of-turn token itself when the model's turn stopped without it (a
stop string, the turn's token limit). A template whose rendering of the
longer conversation does not start with the shorter one's is refused: its
observations cannot be cut out as ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatFormat", "Trajectory", "ChatTemplateError", "tool_instructions"]

# The fixed conversation observations are cut out of (any content works: only the framing is kept).
_BASE = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot frame observations as ids (named, with what it rendered)."""


class ChatFormat:
    """A tokenizer's chat template as token ids: the prompt, and the observations between turns."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, end_of_turn_id: int | None = None,
                 tool_format: str = "hermes") -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ChatTemplateError(f"the tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat "
                                    "template; a multi-turn rollout frames every turn with it")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.end_of_turn_id = tokenizer.eos_token_id if end_of_turn_id is None else end_of_turn_id
        prefix = self._render(_BASE, generation_prompt=False)
        ends = [i for i, token in enumerate(prefix) if token == self.end_of_turn_id]
        if not ends:
            raise ChatTemplateError(
                f"the chat template does not end an assistant turn with the end-of-turn token id "
                f"{self.end_of_turn_id} ({tokenizer.convert_ids_to_tokens(self.end_of_turn_id)!r}); rendered "
                f"{tokenizer.decode(prefix)!r}. Give the token that ends a turn (end_of_turn_id)")
        # What the template writes after an assistant turn's end-of-turn token (ChatML: a newline).
        self.after_turn = prefix[ends[-1] + 1:]
        self._prefix = prefix
        # A template that ignores ``tools`` renders the same with and without them: say them in a system message.
        self.tool_instructions = None
        if self.tools and prefix == self._render(_BASE, generation_prompt=False, tools=None):
            self.tool_instructions = tool_instructions(self.tools, tool_format)

    def _render(self, messages: list[dict], generation_prompt: bool, tools: Any = "configured") -> list[int]:
        tools = self.tools if tools == "configured" else tools
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                 tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt: the template applied to ``messages`` (and the tools), ready for the assistant's turn."""
        return self._render(self.with_tool_instructions(messages), generation_prompt=True)

    def with_tool_instructions(self, messages: list[dict]) -> list[dict]:
        """``messages`` with the tools described in the system message, when the template does not render them."""
        if self.tool_instructions is None:
            return list(messages)
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0], content=f"{messages[0]['content']} {self.tool_instructions}")
            return [first, *messages[1:]]
        return [{"role": "system", "content": self.tool_instructions}, *messages]

    def observation_ids(self, messages: list[dict[str, Any]], closed: bool = True) -> list[int]:
        """The ids that follow a model turn: ``messages`` (tool results, the environment's reply) in the
        template's delimiters, then the next assistant header.

        ``closed``: the model's turn ended with the end-of-turn token; if not, that token comes first.
        """
        if not messages:
            raise ValueError("observation_ids needs at least one message")
        full = self._render(_BASE + list(messages), generation_prompt=True)
        if full[:len(self._prefix)] != self._prefix:
            raise ChatTemplateError(
                "the chat template renders a conversation with more messages so that it does not start with the "
                f"shorter one's ids, so observations cannot be cut out as ids: {self.tokenizer.decode(self._prefix)!r} "
                f"vs {self.tokenizer.decode(full)!r}")
        return ([] if closed else [self.end_of_turn_id]) + self.after_turn + full[len(self._prefix):]


def tool_instructions(tools: list[dict], tool_format: str) -> str:
    """How to call the tools, in the configured format, and their schemas: one line (no newline needed)."""
    functions = json.dumps([spec["function"] for spec in tools], separators=(",", ":"))
    if tool_format == "json":
        how = 'To call a tool, write a line {"tool": NAME, "arguments": {...}} and wait for its result.'
    else:
        how = 'To call a tool, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call> and wait for its result.'
    return f"{how} Answer without a tool call when you are done. Tools: {functions}"


@dataclass
class Trajectory:
    """One sample's conversation as ids: the prompt, then model turns and observations, each kept exactly."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # everything after the prompt
    response_mask: list[int] = field(default_factory=list)  # 1: the model's token, 0: an observation's
    log_probs: list[float] = field(default_factory=list)  # the rollout's, on model tokens; 0.0 elsewhere
    turns: int = 0
    finish_reason: str | None = None

    def add_model_turn(self, token_ids: list[int], log_probs: list[float]) -> None:
        if len(token_ids) != len(log_probs):
            raise ValueError(f"a model turn of {len(token_ids)} ids came with {len(log_probs)} log-probs")
        self.response_ids += token_ids
        self.response_mask += [1] * len(token_ids)
        self.log_probs += [float(x) for x in log_probs]
        self.turns += 1

    def add_observation(self, token_ids: list[int]) -> None:
        self.response_ids += token_ids
        self.response_mask += [0] * len(token_ids)
        self.log_probs += [0.0] * len(token_ids)

    @property
    def context_ids(self) -> list[int]:
        """What the next model turn is generated from: the prompt and everything since."""
        return self.prompt_ids + self.response_ids

    @property
    def model_tokens(self) -> int:
        return sum(self.response_mask)

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
