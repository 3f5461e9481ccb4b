"""The OpenAI-compatible endpoint of the rollout (``rollout.server``): chat and text completions, streamed or
not, served by the rollout replicas.

::

    server = RolloutServer(tokenizer, replica_addresses, sampling, max_model_len, api_key).start()
    server.open_session(session_id)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/sessions/{session_id}/v1", api_key=api_key)
    ...
    server.close()

Routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, and the same under
``/sessions/{id}/v1/...`` for a client that belongs to one session (the trainer gives each agent sample one,
under an id no other process can guess), or the session an ``X-Session-Id`` header names. A session must be open
(``open_session``): an unknown id is answered 404 and creates nothing. A request that names none is a session of
its own for as long as it runs. Any model name is served: the policy.

Every request needs the job's API key (``Authorization: Bearer``, as the ``openai`` client sends it; else 401).
At most ``max_sessions`` sessions at once (else 429) and ``max_n`` choices a request (else 400), each refusal
naming its cap; ``max_tokens`` is bounded by the rollout's ``max_new_tokens`` and a body by 64 MiB.

A chat request's messages go through the tokenizer's chat template (with its ``tools``); a reply's tool
calls are read out of the sampled text in ``tool_format`` (``workers.rollout.agent.tool_calls``) and returned
as OpenAI ``tool_calls``. Each request is recorded in its session as the ids served
(``session.Session``), which is what the trainer trains on, never the text.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import uuid
from typing import Any

from controller.serving.messages import assistant_message, template_messages, tool_call_json
from controller.serving.openai_protocol import (RequestError, chat_response, completion_response, sampling_fields,
                                                stream_chunk)
from controller.serving.router import ReplicaError, ReplicaRouter
from controller.serving.session import ServedTurn, Session, SessionStore, TooManySessions, UnknownSession
from workers.rollout.serving.api_key import require_api_key

__all__ = ["RolloutServer"]


class RolloutServer:
    def __init__(self, tokenizer, replicas: list[str], sampling, max_model_len: int, api_key: str,
                 tool_format: str = "hermes", host: str = "127.0.0.1", port: int = 0, model_name: str = "policy",
                 fixed_sampling: bool = False, max_sessions: int = 256, max_n: int = 16) -> None:
        """``sampling``: the rollout's SamplingConfig, what a request does not set; ``max_model_len``: the
        engines' context (prompt and completion); ``api_key``: the job's key, which every request to this
        server and to the replicas carries. ``fixed_sampling`` (training): a request's temperature,
        top_p and top_k are the rollout's whatever it asks, so that the log-probs served are those the update
        compares with; its max_tokens and stop strings are kept. ``max_sessions`` / ``max_n``: the caps
        (``rollout.server_max_sessions`` / ``server_max_n``)."""
        self.tokenizer, self.sampling, self.max_model_len = tokenizer, sampling, max_model_len
        self.fixed_sampling = fixed_sampling
        self.tool_format, self.host, self.model_name = tool_format, host, model_name
        self.port = port or _free_port(host)
        self.router = ReplicaRouter(replicas, api_key)
        self.sessions = SessionStore(max_sessions)
        self.max_n, self.api_key = max_n, api_key  # the key: for the clients this process hands out, never logged
        self._auth = require_api_key(api_key)
        self._chat_formats: dict[str, Any] = {}
        self._thread: threading.Thread | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._runner = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.stats = {"requests": 0, "errors": 0}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ lifetime
    def start(self) -> "RolloutServer":
        self._thread = threading.Thread(target=self._serve, name="hybridflow-openai-server", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._start_error is not None:
            raise RuntimeError(f"the rollout server could not start on {self.url}: {self._start_error}")
        return self

    def close(self) -> None:
        if self._aio is not None:
            async def shutdown():
                await self.router.close()
                await self._runner.cleanup()
                await _cancel_others()

            asyncio.run_coroutine_threadsafe(shutdown(), self._aio).result(30)
            self._aio.call_soon_threadsafe(self._aio.stop)
        if self._thread is not None:
            self._thread.join(30)
        self._thread = self._aio = self._runner = None

    def __enter__(self) -> "RolloutServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def open_session(self, session_id: str, seed: int | None = None, **limits: int | None) -> Session:
        return self.sessions.open(session_id, seed, **limits)

    def take_session(self, session_id: str) -> Session:
        """The session's record, removed from the server (and from its replica's load)."""
        self.router.close_session(session_id)
        return self.sessions.pop(session_id)

    def _serve(self) -> None:
        from aiohttp import web

        self._aio = asyncio.new_event_loop()
        asyncio.set_event_loop(self._aio)
        app = web.Application(client_max_size=64 << 20, middlewares=[self._auth])
        for prefix in ("", "/sessions/{session}"):
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
        try:
            self._runner = web.AppRunner(app, access_log=None)
            self._aio.run_until_complete(self._runner.setup())
            self._aio.run_until_complete(web.TCPSite(self._runner, self.host, self.port, shutdown_timeout=2.0).start())
        except BaseException as exc:  # noqa: BLE001 (start reports it)
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        self._aio.run_forever()

    # ------------------------------------------------------------------ helpers
    def _session(self, request) -> tuple[Session, bool]:
        """The request's session, and whether it is its own for this request only (it names none)."""
        named = request.match_info.get("session") or request.headers.get("X-Session-Id")
        if named:
            return self.sessions.get(named), False
        return self.sessions.transient(), True

    def _release(self, session: Session) -> None:
        self.router.close_session(session.session_id)
        self.sessions.pop(session.session_id)

    def _chat_format(self, tools: list[dict] | None):
        from workers.rollout.agent.trajectory import ChatFormat

        key = json.dumps(tools, sort_keys=True) if tools else ""
        if key not in self._chat_formats:
            self._chat_formats[key] = ChatFormat(self.tokenizer, tools=tools or None,
                                                 end_of_turn_id=self.tokenizer.eos_token_id,
                                                 tool_format=self.tool_format)
        return self._chat_formats[key]

    def _fields(self, body: dict) -> tuple[dict, int]:
        sampling, n = sampling_fields(body, self.sampling.max_new_tokens)
        if n > self.max_n:
            raise RequestError(f"n {n} is over this server's {self.max_n} choices a request "
                               f"(rollout.server_max_n)")
        if self.fixed_sampling:
            for name in ("temperature", "top_p", "top_k"):
                sampling.pop(name, None)
        return sampling, n

    def _check_length(self, prompt_ids: list[int], sampling: dict, session: Session | None = None,
                      parent: int | None = None) -> None:
        room = self.max_model_len - len(prompt_ids)
        if session is not None:
            left = session.room(prompt_ids, parent)
            room = room if left is None else min(room, left)
        wanted = sampling.get("max_new_tokens", self.sampling.max_new_tokens)
        if room < 1:
            raise RequestError(f"the prompt is {len(prompt_ids)} tokens, and the engine's context is "
                               f"{self.max_model_len}")
        if wanted > room:
            sampling["max_new_tokens"] = room  # as OpenAI's servers do: the completion ends at the context

    def _seeded(self, session: Session, sampling: dict, choice: int) -> dict:
        seed = sampling.get("seed")
        return {**sampling, "seed": seed + choice if seed is not None else session.next_seed()}

    @staticmethod
    def _error(status: int, message: str):
        from aiohttp import web

        kind = "server_error" if status >= 500 else "invalid_request_error"
        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                               "owned_by": "hybridflow"}]})

    # ------------------------------------------------------------------ chat
    async def _answering(self, request, answer):
        """``answer(request, session)``'s response: a request the server cannot take is HTTP 400, an unknown
        session 404, one past the sessions' cap 429, a replica's failure 502."""
        self.stats["requests"] += 1
        session, transient = None, False
        try:
            session, transient = self._session(request)
            return await answer(request, session)
        except (RequestError, ValueError, json.JSONDecodeError) as exc:
            failure = (400, str(exc))
        except UnknownSession as exc:
            failure = (404, str(exc))
        except TooManySessions as exc:
            failure = (429, str(exc))
        except ReplicaError as exc:
            failure = (502, str(exc))
        finally:
            if transient:
                self._release(session)
        self.stats["errors"] += 1
        return self._error(*failure)

    async def _served(self, session: Session, prompt_ids: list[int], sampling: dict, n: int) -> list[dict]:
        """``n`` completions of ``prompt_ids`` on the session's replica, each with its own seed."""
        return list(await asyncio.gather(*(self.router.generate(session.session_id, prompt_ids,
                                                                self._seeded(session, sampling, k))
                                           for k in range(n))))

    async def _chat(self, request):
        return await self._answering(request, self._chat_body)

    async def _chat_body(self, request, session: Session):
        body = await request.json()
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of chat messages")
        sampling, n = self._fields(body)
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        chat = self._chat_format(tools)
        conversation = template_messages(messages)
        prompt_ids, parent = session.chat_prompt(conversation, chat)
        self._check_length(prompt_ids, sampling, session, parent)
        if body.get("stream"):
            if n != 1:
                raise RequestError("stream serves one choice: n must be 1")
            return await self._chat_stream(request, body, session, conversation, prompt_ids, parent, sampling,
                                           tools is not None)
        served = await self._served(session, prompt_ids, sampling, n)
        choices, turns = [], []
        for out in served:
            choice = self._chat_choice(out, tools is not None)
            turns.append(session.record(ServedTurn(prompt_ids, out["token_ids"], out["log_probs"], out["versions"],
                                                   out["finish_reason"], parent, conversation, choice["message"])))
            choices.append(choice)
        from aiohttp import web

        return web.json_response(chat_response(body.get("model") or self.model_name, prompt_ids, choices,
                                               session.session_id, turns, bool(body.get("logprobs"))))

    def _chat_choice(self, out: dict, with_tools: bool) -> dict:
        text = self.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
        content, calls = text, []
        if with_tools:
            from workers.rollout.agent.tool_calls import parse_tool_calls

            reply = parse_tool_calls(text, self.tool_format, tokenizer=self.tokenizer)
            if reply.calls:
                content = reply.content.strip()
                calls = [tool_call_json(c.name, c.arguments, f"call_{uuid.uuid4().hex[:24]}") for c in reply.calls]
        finish = "tool_calls" if calls else out["finish_reason"]
        return {"message": assistant_message(content, calls), "finish_reason": finish, "token_ids": out["token_ids"],
                "log_probs": out["log_probs"], "versions": out["versions"], "raw_content": text,
                "tokens": self.tokenizer.convert_ids_to_tokens(out["token_ids"])}

    async def _chat_stream(self, request, body, session, conversation, prompt_ids, parent, sampling, with_tools):
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        model, response_id = body.get("model") or self.model_name, f"chatcmpl-{uuid.uuid4().hex}"
        served = {"token_ids": [], "log_probs": [], "versions": [], "finish_reason": None}
        sent = ""
        await _event(response, stream_chunk("chat", response_id, model, {"role": "assistant", "content": ""}))
        async for tokens in self.router.stream(session.session_id, prompt_ids, self._seeded(session, sampling, 0)):
            if str(tokens.get("finish_reason") or "").startswith("error"):
                raise RequestError(tokens["finish_reason"])
            for key, name in (("token_ids", "token_ids"), ("log_probs", "log_probs"), ("versions", "versions")):
                served[key] += tokens[name]
            served["finish_reason"] = tokens.get("finish_reason")
            text = self.tokenizer.decode(served["token_ids"], skip_special_tokens=True)
            if not with_tools and text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
                await _event(response, stream_chunk("chat", response_id, model, {"content": text[len(sent):]}))
                sent = text
        choice = self._chat_choice(served, with_tools)
        message = choice["message"]
        turn = session.record(ServedTurn(prompt_ids, served["token_ids"], served["log_probs"], served["versions"],
                                         served["finish_reason"], parent, conversation, message))
        final: dict[str, Any] = {}
        if message.get("tool_calls"):
            final["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            if message.get("content"):
                final["content"] = message["content"]
        elif (message.get("content") or "") != sent:
            final["content"] = (message.get("content") or "")[len(sent):]
        extra = {"token_ids": served["token_ids"], "token_logprobs": served["log_probs"],
                 "policy_versions": served["versions"], "raw_content": choice["raw_content"],
                 "prompt_token_ids": prompt_ids,
                 "hybridflow": {"session": session.session_id, "turns": [turn]},
                 "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(served["token_ids"]),
                           "total_tokens": len(prompt_ids) + len(served["token_ids"])}}
        await _event(response, stream_chunk("chat", response_id, model, final, choice["finish_reason"], extra))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ------------------------------------------------------------------ text completions
    async def _completions(self, request):
        return await self._answering(request, self._completions_body)

    async def _completions_body(self, request, session: Session):
        from aiohttp import web

        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise RequestError("prompt must be a string or a non-empty list of token ids (one prompt a request)")
        sampling, n = self._fields(body)
        parent = session.completion_prompt(prompt_ids)
        self._check_length(prompt_ids, sampling, session, parent)
        if body.get("stream"):
            if n != 1:
                raise RequestError("stream serves one choice: n must be 1")
            return await self._completion_stream(request, body, session, prompt_ids, parent, sampling)
        served = await self._served(session, prompt_ids, sampling, n)
        choices, turns = [], []
        for out in served:
            turns.append(session.record(ServedTurn(prompt_ids, out["token_ids"], out["log_probs"], out["versions"],
                                                   out["finish_reason"], parent)))
            choices.append({"text": self.tokenizer.decode(out["token_ids"], skip_special_tokens=True),
                            "finish_reason": out["finish_reason"], "token_ids": out["token_ids"],
                            "log_probs": out["log_probs"], "versions": out["versions"],
                            "tokens": self.tokenizer.convert_ids_to_tokens(out["token_ids"])})
        return web.json_response(completion_response(body.get("model") or self.model_name, prompt_ids, choices,
                                                     session.session_id, turns, bool(body.get("logprobs"))))

    async def _completion_stream(self, request, body, session, prompt_ids, parent, sampling):
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        model, response_id = body.get("model") or self.model_name, f"cmpl-{uuid.uuid4().hex}"
        ids, log_probs, versions, finish, sent = [], [], [], None, ""
        async for tokens in self.router.stream(session.session_id, prompt_ids, self._seeded(session, sampling, 0)):
            ids += tokens["token_ids"]
            log_probs += tokens["log_probs"]
            versions += tokens["versions"]
            finish = tokens.get("finish_reason")
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
                await _event(response, stream_chunk("text", response_id, model, text[len(sent):]))
                sent = text
        turn = session.record(ServedTurn(prompt_ids, ids, log_probs, versions, finish, parent))
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        extra = {"token_ids": ids, "token_logprobs": log_probs, "policy_versions": versions,
                 "prompt_token_ids": prompt_ids, "hybridflow": {"session": session.session_id, "turns": [turn]}}
        await _event(response, stream_chunk("text", response_id, model, text[len(sent):], finish, extra))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _cancel_others() -> None:
    """Cancel what is left on this loop (kept-alive connections' handlers) and let it finish."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


async def _event(response, data: dict) -> None:
    await response.write(f"data: {json.dumps(data)}\n\n".encode())


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
