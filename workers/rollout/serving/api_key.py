"""The per-job secret that every rollout endpoint requires (``Authorization: Bearer <key>``), as OpenAI's
servers do: the OpenAI-compatible front end and each replica's ``/generate``, ``/update``, ``/stop`` and
``/health``. Loopback is not a boundary: any process of the machine can reach it, and a request that reaches
a training session adds turns the policy is trained on, or a replica's ``/update`` swaps its weights.

The key is ``rollout.server_api_key``, or a new random one for each job (``new_api_key``); it is never logged.
The controller hands it to the replicas with the call that starts them, and to a user's agent inside the
``openai`` client it is given.
"""

from __future__ import annotations

import hmac
import secrets

__all__ = ["authorization", "bearer", "new_api_key", "require_api_key"]


def new_api_key() -> str:
    """A fresh key: 32 random bytes, URL-safe text."""
    return secrets.token_urlsafe(32)


def bearer(api_key: str) -> dict[str, str]:
    """The header a client of these endpoints sends."""
    return {"Authorization": f"Bearer {api_key}"}


def _checked(api_key: str) -> str:
    if not isinstance(api_key, str) or not api_key.strip():
        raise ValueError(f"a rollout endpoint needs a non-empty API key, got {type(api_key).__name__}")
    return api_key


def authorization(request, api_key: str) -> bool:
    """Whether ``request`` carries ``api_key`` (compared in constant time)."""
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


def require_api_key(api_key: str):
    """An aiohttp middleware that answers 401, in OpenAI's error form, to a request without ``api_key``."""
    from aiohttp import web

    api_key = _checked(api_key)

    @web.middleware
    async def authenticated(request, handler):
        if not authorization(request, api_key):
            message = ("this endpoint needs the job's API key (Authorization: Bearer <key>): the client hybridflow "
                       "gives an agent carries it; rollout.server_api_key sets it")
            return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                                 "code": "invalid_api_key"}}, status=401)
        return await handler(request)

    return authenticated
