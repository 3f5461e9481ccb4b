"""Sessions spread over the rollout's replicas, each kept on one (its prefix cache stays warm).

A new session goes to the replica with the fewest open sessions; every later request of it goes to the same
one. Requests reach a replica as token ids (``workers.rollout.serving.ReplicaServer``'s ``/generate``), with the
job's API key.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from workers.rollout.serving.api_key import bearer

__all__ = ["ReplicaRouter", "ReplicaError"]


class ReplicaError(RuntimeError):
    """A replica refused a request or could not be reached; the message names it."""


class ReplicaRouter:
    def __init__(self, addresses: list[str], api_key: str) -> None:
        if not addresses:
            raise ValueError("a router needs at least one replica address")
        self.addresses, self.api_key = list(addresses), api_key
        self.sessions = [0] * len(addresses)  # open sessions per replica
        self.requests = [0] * len(addresses)  # requests sent per replica
        self._where: dict[str, int] = {}
        self._http = None

    def replica(self, session_id: str) -> int:
        """The replica of ``session_id``: where it went first, else the least loaded."""
        if session_id not in self._where:
            chosen = min(range(len(self.addresses)), key=lambda i: (self.sessions[i], i))
            self._where[session_id] = chosen
            self.sessions[chosen] += 1
        return self._where[session_id]

    def close_session(self, session_id: str) -> None:
        where = self._where.pop(session_id, None)
        if where is not None:
            self.sessions[where] -= 1

    async def _client(self):
        import aiohttp

        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), headers=bearer(self.api_key))
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def generate(self, session_id: str, prompt_ids: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        """The whole completion of one request: prompt and sampled ids, log-probs, versions, finish reason."""
        import aiohttp

        index = self.replica(session_id)
        self.requests[index] += 1
        http = await self._client()
        address = self.addresses[index]
        try:
            async with http.post(f"{address}/generate", json={"prompt_ids": prompt_ids, "sampling": sampling}) as reply:
                body = await reply.json(content_type=None)
        except (aiohttp.ClientError, ValueError) as exc:
            raise ReplicaError(f"replica {index} ({address}) could not be reached: {exc}") from exc
        if reply.status != 200:
            raise ReplicaError(f"replica {index} ({address}) refused the request: {body.get('error', body)}")
        return body

    async def stream(self, session_id: str, prompt_ids: list[int], sampling: dict[str, Any]
                     ) -> AsyncIterator[dict[str, Any]]:
        """The completion of one request as the replica samples it: one dict of new tokens at a time."""
        index = self.replica(session_id)
        self.requests[index] += 1
        http = await self._client()
        address = self.addresses[index]
        import aiohttp

        try:
            async with http.post(f"{address}/generate",
                                 json={"prompt_ids": prompt_ids, "sampling": sampling, "stream": True}) as reply:
                if reply.status != 200:
                    body = await reply.json(content_type=None)
                    raise ReplicaError(f"replica {index} ({address}) refused the request: {body.get('error', body)}")
                async for line in reply.content:
                    if line.strip():
                        yield json.loads(line)
        except aiohttp.ClientError as exc:
            raise ReplicaError(f"replica {index} ({address}) could not be reached: {exc}") from exc
