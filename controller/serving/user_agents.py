"""Users' agents as the environment: ``async def agent(client, row) -> float | None``, one call per sample.

``client`` is an ``openai.AsyncOpenAI`` whose base URL is the sample's own session on the rollout server
(any model name is the policy); ``row`` is the data row as a dict. The agent talks to the model however it
likes (tools, several turns, sub-agents, streaming) and returns the sample's reward, or None to let
``reward.fn`` score the last assistant message. Many run at once (``max_concurrent``); each has its own
timeout; one that raises, times out or returns something else ends its own sample only, which is counted.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import secrets
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from controller.serving.session import ServedTurn

__all__ = ["AGENT_STATUSES", "SessionOutcome", "agent_row", "load_agent", "run_sessions"]

AGENT_STATUSES = ("ok", "timeout", "error", "bad_reward", "no_requests")

Agent = Callable[[Any, dict], Awaitable[float | None]]


def load_agent(entrypoint: str) -> Agent:
    """``package.module:function``, an ``async def`` of two parameters (client, row); a ValueError otherwise."""
    from workers.import_path import import_object

    if ":" not in entrypoint:
        raise ValueError(f"rollout.agent.entrypoint {entrypoint!r} is not 'package.module:function'")
    fn = import_object(entrypoint, "agent entrypoint")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.agent.entrypoint {entrypoint!r} is {fn!r}: it must be an 'async def agent(client, "
                         f"row)'")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ValueError(f"rollout.agent.entrypoint {entrypoint!r} must take two arguments (client, row); its "
                         f"signature is {inspect.signature(fn)}") from None
    return fn


def agent_row(row: dict) -> dict:
    """The row an agent gets: the data row's fields (``messages``, ``ground_truth``, ``uid``, ``data_source``,
    ``extra_info``), and verl's names for the two an agent reads most, so that an agent written for verl's schema
    runs as it is: ``prompt`` (the chat messages) and ``reward_model`` (``{"style": "rule", "ground_truth"}``)."""
    out = dict(row)
    if "messages" in out:
        out.setdefault("prompt", out["messages"])
    if "ground_truth" in out:
        out.setdefault("reward_model", {"style": "rule", "ground_truth": out["ground_truth"]})
    return out


@dataclass
class SessionOutcome:
    session_id: str
    row: int  # the sample's index in the batch
    status: str  # one of AGENT_STATUSES
    reward: float | None
    turns: list[ServedTurn] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    traceback: str | None = None  # where the agent raised (status "error")


async def run_sessions(agent: Agent, rows: list[dict], server, seeds: list[int | None], max_concurrent: int,
                       timeout_s: float, limits: dict[str, int | None] | None = None,
                       prefix: str = "sample", gate: asyncio.Semaphore | None = None) -> list[SessionOutcome]:
    """``agent`` once per row, each on a session of its own on ``server`` (a ``RolloutServer``), at most
    ``max_concurrent`` at a time (or as many as ``gate``, shared with other calls, lets through); the
    outcomes in the rows' order."""
    import openai

    gate = gate or asyncio.Semaphore(max_concurrent)

    async def one(index: int, row: dict) -> SessionOutcome:
        session_id = f"{prefix}-{index}-{secrets.token_hex(16)}"  # unguessable: the key is not the only lock
        async with gate:
            server.open_session(session_id, seeds[index], **(limits or {}))
            client = openai.AsyncOpenAI(base_url=f"{server.url}/sessions/{session_id}/v1", api_key=server.api_key,
                                        max_retries=0, timeout=timeout_s)
            start = time.perf_counter()
            status, reward, error, trace = "ok", None, None, None
            try:
                reward = await asyncio.wait_for(agent(client, dict(row)), timeout_s)
                if reward is not None:
                    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                        status, error = "bad_reward", f"the agent returned {reward!r}, not a finite number or None"
                        reward = None
                    else:
                        reward = float(reward)
            except asyncio.TimeoutError:
                status, error = "timeout", f"the agent did not return within {timeout_s:g} s"
            except Exception as exc:  # noqa: BLE001 (the user's code: its sample ends, the step goes on)
                status, error, trace = "error", f"{type(exc).__name__}: {exc}", traceback.format_exc()
            finally:
                await client.close()
            seconds = time.perf_counter() - start
        turns = server.take_session(session_id).turns
        if status == "ok" and not turns:
            status, error = "no_requests", "the agent never asked the model"
        return SessionOutcome(session_id, index, status, reward if status == "ok" else None, turns, error, seconds,
                              trace)

    return list(await asyncio.gather(*(one(i, row) for i, row in enumerate(rows))))
