"""One generation replica's token-in, token-out HTTP endpoint, over its ``EngineLoop``.

``POST /generate`` with ``{"prompt_ids": [...], "sampling": {...}, "stream": false}`` answers
``{"prompt_ids", "token_ids", "log_probs", "versions", "finish_reason"}``; with ``"stream": true`` it
answers newline-delimited JSON, one ``ServedTokens`` as it is sampled per line. A client that goes away
aborts its request. ``POST /update`` (``{"policy": "pause" | "finish"}``) takes the policy's current weights
while serving: the requests in flight pause and go on with them, or finish first. ``GET /health`` gives the
loop's state; ``POST /stop`` ends the serving (once the requests in flight are done). Every endpoint needs the
job's API key (``api_key``: a request without it is answered 401). The server runs on its own thread and event
loop; the engine steps on the thread that calls ``EngineLoop.run``. The OpenAI-compatible front end (chat templates, tools, sessions) is
the controller's (``controller.serving``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading

from typing import Callable

from workers.rollout.serving.api_key import require_api_key
from workers.rollout.serving.engine_loop import UPDATE_POLICIES, EngineLoop, ServedTokens

__all__ = ["ReplicaServer"]


class ReplicaServer:
    def __init__(self, loop: EngineLoop, api_key: str, host: str = "127.0.0.1", port: int = 0,
                 on_update: Callable[[], dict] | None = None) -> None:
        """``api_key``: what every request must carry (``workers.rollout.serving.api_key``); ``on_update``: takes
        the policy's current weights into the engine (``POST /update``), on the stepping thread between steps;
        None: this replica's weights do not change while it serves."""
        self.loop, self.host, self.on_update = loop, host, on_update
        self._auth = require_api_key(api_key)
        self.port = port or _free_port(host)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._runner = None

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ReplicaServer":
        self._thread = threading.Thread(target=self._serve, name="hybridflow-replica-server", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"the replica server could not start on {self.address}: {self._error}")
        return self

    def close(self) -> None:
        if self._aio is not None and self._runner is not None:
            async def shutdown():
                await self._runner.cleanup()
                others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in others:  # kept-alive connections' handlers
                    task.cancel()
                await asyncio.gather(*others, return_exceptions=True)

            asyncio.run_coroutine_threadsafe(shutdown(), self._aio).result(30)
            self._aio.call_soon_threadsafe(self._aio.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._thread = self._aio = self._runner = None

    # ------------------------------------------------------------------ the server's thread
    def _serve(self) -> None:
        from aiohttp import web

        self._aio = asyncio.new_event_loop()
        asyncio.set_event_loop(self._aio)
        app = web.Application(client_max_size=64 << 20, middlewares=[self._auth])
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_post("/stop", self._stop)
        app.router.add_post("/update", self._update)
        try:
            self._runner = web.AppRunner(app, access_log=None)
            self._aio.run_until_complete(self._runner.setup())
            self._aio.run_until_complete(web.TCPSite(self._runner, self.host, self.port, shutdown_timeout=2.0).start())
        except BaseException as exc:  # noqa: BLE001 (reported by start)
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._aio.run_forever()

    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"version": self.loop.version, "in_flight": self.loop.in_flight, **self.loop.stats})

    async def _stop(self, request):
        from aiohttp import web

        self.loop.stop()
        return web.json_response({"stopping": True})

    async def _update(self, request):
        """New weights while serving, ``{"policy": "pause" | "finish"}`` (``EngineLoop.update``); answers once
        they are in, with the sync's metrics, the new policy version, and what the update did to the requests
        in flight (``update/requests_paused``, ``update/requests_finished_first``, ``update/wait_s``)."""
        from aiohttp import web

        body = await request.json() if request.can_read_body else {}
        policy = body.get("policy", "pause")
        if self.on_update is None:
            return web.json_response({"error": "this replica takes no weights while it serves"}, status=400)
        if policy not in UPDATE_POLICIES:
            return web.json_response({"error": f"policy {policy!r} is not one of {UPDATE_POLICIES}"}, status=400)
        taken = await asyncio.get_running_loop().run_in_executor(None, self.loop.update, self.on_update, policy)
        metrics = {k: v for k, v in (taken.result or {}).items() if isinstance(v, (int, float, str))}
        return web.json_response({"version": self.loop.version, **metrics, "update/requests_paused": taken.paused,
                                  "update/requests_finished_first": taken.finished_first,
                                  "update/wait_s": taken.wait_s})

    async def _generate(self, request):
        from aiohttp import web

        body = await request.json()
        prompt_ids, sampling = body.get("prompt_ids"), body.get("sampling") or {}
        if not isinstance(prompt_ids, list) or not prompt_ids or not all(isinstance(t, int) for t in prompt_ids):
            return web.json_response({"error": "prompt_ids must be a non-empty list of token ids"}, status=400)
        events: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()
        request_id = self.loop.submit(prompt_ids, sampling,
                                      lambda tokens: aio.call_soon_threadsafe(events.put_nowait, tokens))
        try:
            if body.get("stream"):
                response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
                await response.prepare(request)
                while True:
                    tokens: ServedTokens = await events.get()
                    await response.write((json.dumps(dataclasses.asdict(tokens)) + "\n").encode())
                    if tokens.finish_reason is not None:
                        break
                await response.write_eof()
                return response
            whole = ServedTokens([], [], [], None, [])
            while whole.finish_reason is None:
                tokens = await events.get()
                whole.prompt_ids = whole.prompt_ids or tokens.prompt_ids
                whole.token_ids += tokens.token_ids
                whole.log_probs += tokens.log_probs
                whole.versions += tokens.versions
                whole.finish_reason = tokens.finish_reason
            if whole.finish_reason.startswith("error"):
                return web.json_response({"error": whole.finish_reason}, status=400)
            whole.prompt_ids = whole.prompt_ids or prompt_ids
            return web.json_response(dataclasses.asdict(whole))
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away: its request ends
            self.loop.abort(request_id)
            raise


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
