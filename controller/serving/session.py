"""A session: the requests one agent sample makes, as the ids the engine was given and gave back.

Each request's prompt is built by appending to what the session was served when it can be:

- a chat request whose messages are an earlier request's messages, then the reply the server gave it, then
  new messages (tool results, the user's next turn) continues that reply: its prompt is the earlier prompt,
  the reply's sampled ids, and the new messages in the chat template's own delimiters
  (``ChatFormat.observation_ids``); nothing the model said is tokenized again;
- a completion request continues when its prompt ids start with an earlier prompt and completion.

Anything else (the client rewrote or dropped history, or the template renders it otherwise) is rendered from
scratch and starts a new branch: ``ServedTurn.parent`` is None. ``trajectories.session_samples`` turns the
turns into training samples.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field

from controller.serving.messages import normalized

__all__ = ["ServedTurn", "Session", "SessionStore", "TooManySessions", "UnknownSession"]


@dataclass
class ServedTurn:
    """One choice of one request: the prompt given to the engine and what it sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    versions: list[int]
    finish_reason: str
    parent: int | None  # the turn whose prompt and completion this prompt starts with; None: a new branch
    messages: list[dict] = field(default_factory=list)  # the conversation the request sent (chat)
    reply: dict | None = None  # the assistant message returned (chat)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


class Session:
    """``seed``: the session's first request draws from it, the k-th from ``seed + k`` (unless the request
    gives its own); None: unseeded."""

    def __init__(self, session_id: str, seed: int | None = None, max_prompt_length: int | None = None,
                 max_response_length: int | None = None) -> None:
        """``max_prompt_length`` / ``max_response_length``: what one training sample holds (the trainer's
        sessions); a request past them is refused, and a completion is cut to fit."""
        self.session_id, self.seed = session_id, seed
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.turns: list[ServedTurn] = []
        self.requests = 0
        self.lock = threading.Lock()

    def next_seed(self) -> int | None:
        seed = None if self.seed is None else self.seed + self.requests
        self.requests += 1
        return seed

    def chat_prompt(self, messages: list[dict], chat) -> tuple[list[int], int | None]:
        """The prompt ids of a chat request and the turn it continues (None: rendered from scratch)."""
        wanted = [normalized(m) for m in messages]
        for index in range(len(self.turns) - 1, -1, -1):
            turn = self.turns[index]
            if turn.reply is None:
                continue
            before = [normalized(m) for m in turn.messages] + [normalized(turn.reply)]
            if len(wanted) > len(before) and wanted[:len(before)] == before:
                closed = turn.completion_ids[-1:] == [chat.end_of_turn_id]  # else the framing adds it
                return turn.ids + chat.observation_ids(messages[len(before):], closed=closed), index
        return chat.prompt_ids(messages), None

    def completion_prompt(self, prompt_ids: list[int]) -> int | None:
        """The turn a completion request's prompt continues (the longest served sequence it starts with)."""
        best, length = None, -1
        for index, turn in enumerate(self.turns):
            ids = turn.ids
            if len(prompt_ids) > len(ids) > length and prompt_ids[:len(ids)] == ids:
                best, length = index, len(ids)
        return best

    def room(self, prompt_ids: list[int], parent: int | None) -> int | None:
        """Tokens a completion of ``prompt_ids`` may take within the sample's limits (None: no limits); a
        ValueError when the prompt alone is past them."""
        if self.max_prompt_length is None and self.max_response_length is None:
            return None
        root = parent
        while root is not None and self.turns[root].parent is not None:
            root = self.turns[root].parent
        first = len(prompt_ids) if root is None else len(self.turns[root].prompt_ids)
        if self.max_prompt_length is not None and first > self.max_prompt_length:
            raise ValueError(f"the conversation's first prompt is {first} tokens, over rollout.max_prompt_length "
                             f"{self.max_prompt_length}")
        if self.max_response_length is None:
            return None
        left = first + self.max_response_length - len(prompt_ids)
        if left < 1:
            raise ValueError(f"the conversation is {len(prompt_ids) - first} tokens after its first prompt, and a "
                             f"sample holds {self.max_response_length} (rollout.agent.max_response_length)")
        return left

    def record(self, turn: ServedTurn) -> int:
        self.turns.append(turn)
        return len(self.turns) - 1


class UnknownSession(LookupError):
    """A request names a session this server does not hold (HTTP 404); nothing is created."""


class TooManySessions(RuntimeError):
    """The server holds ``max_sessions`` already (HTTP 429); the message names the cap."""


class SessionStore:
    """The sessions of one serving, by id, at most ``max_sessions`` at once (``rollout.server_max_sessions``).

    The trainer opens each of its sessions (``open``), under an id no other process can guess, and takes it
    when its agent is done (``pop``). A request that names a session reaches it only if it is open
    (``get``); a request that names none is a session of its own for as long as it runs (``transient``)."""

    def __init__(self, max_sessions: int = 256) -> None:
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def _room(self) -> None:
        if len(self.sessions) >= self.max_sessions:
            raise TooManySessions(f"the server holds {len(self.sessions)} sessions, its cap "
                                  f"(rollout.server_max_sessions={self.max_sessions}): try again when one ends")

    def get(self, session_id: str) -> Session:
        with self._lock:
            if session_id not in self.sessions:
                raise UnknownSession(f"no open session {session_id!r} on this server")
            return self.sessions[session_id]

    def transient(self) -> Session:
        """A session for one request that names none, under a random id; ``pop`` it when the request ends."""
        with self._lock:
            self._room()
            session = Session(f"request-{secrets.token_hex(16)}")
            self.sessions[session.session_id] = session
            return session

    def open(self, session_id: str, seed: int | None = None, **limits: int | None) -> Session:
        """A new session (the trainer's, one per agent sample; ``limits``: ``Session``'s)."""
        with self._lock:
            if session_id in self.sessions:
                raise ValueError(f"session {session_id!r} is already open")
            self._room()
            self.sessions[session_id] = session = Session(session_id, seed, **limits)
            return session

    def pop(self, session_id: str) -> Session:
        with self._lock:
            return self.sessions.pop(session_id)
