"""The OpenAI wire format: a request's sampling settings, and the responses and stream chunks the server sends.

Besides the standard fields, every choice carries what the engine served, which OpenAI's own clients ignore
(their models keep unknown fields): ``token_ids`` (the sampled ids), ``token_logprobs`` (their log-probs
under the sampling distribution), ``policy_versions`` (the weights that sampled each) and, for a chat reply,
``raw_content`` (its whole text, tool-call blocks included), and the response
carries ``prompt_token_ids`` and ``hybridflow: {"session", "turns"}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

__all__ = ["RequestError", "chat_response", "completion_response", "sampling_fields", "stream_chunk"]


class RequestError(ValueError):
    """A request the server cannot take (HTTP 400); the message names the field and what is valid."""


def sampling_fields(body: dict[str, Any], max_new_tokens: int) -> tuple[dict[str, Any], int]:
    """A request's sampling as SamplingConfig fields (only those it sets) and its number of choices."""
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "seed", "ignore_eos"):
        if body.get(name) is not None:
            out[name] = body[name]
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        if not isinstance(limit, int) or limit < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {limit!r}")
        if limit > max_new_tokens:
            raise RequestError(f"max_tokens {limit} is over this rollout's {max_new_tokens} tokens a turn "
                               f"(rollout.sampling.max_new_tokens)")
        out["max_new_tokens"] = limit
    stop = body.get("stop")
    if stop is not None:
        out["stop"] = [stop] if isinstance(stop, str) else list(stop)
    n = 1 if body.get("n") is None else body["n"]
    if not isinstance(n, int) or n < 1:
        raise RequestError(f"n must be a positive integer, got {n!r}")
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs is not served: each token comes with its own log-prob only (logprobs: true)")
    return out, n


def _logprobs(tokens: list[str], log_probs: list[float]) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, log_probs)]}


def _usage(prompt: int, completions: list[dict]) -> dict[str, int]:
    generated = sum(len(c["token_ids"]) for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _served(choice: dict) -> dict[str, Any]:
    served = {"token_ids": choice["token_ids"], "token_logprobs": choice["log_probs"],
              "policy_versions": choice["versions"]}
    if "raw_content" in choice:  # a chat reply's whole text, tool-call blocks included
        served["raw_content"] = choice["raw_content"]
    return served


def chat_response(model: str, prompt_ids: list[int], choices: list[dict], session: str, turns: list[int],
                  want_logprobs: bool) -> dict[str, Any]:
    """``choices``: dicts with the reply ``message``, ``finish_reason``, ``token_ids``, ``log_probs``,
    ``versions`` and ``tokens`` (each id's text, for logprobs)."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": k, "message": c["message"], "finish_reason": c["finish_reason"],
                     "logprobs": _logprobs(c["tokens"], c["log_probs"]) if want_logprobs else None, **_served(c)}
                    for k, c in enumerate(choices)],
        "usage": _usage(len(prompt_ids), choices),
        "prompt_token_ids": prompt_ids, "hybridflow": {"session": session, "turns": turns},
    }


def completion_response(model: str, prompt_ids: list[int], choices: list[dict], session: str, turns: list[int],
                        want_logprobs: bool) -> dict[str, Any]:
    """``choices``: dicts with ``text``, ``finish_reason``, ``token_ids``, ``log_probs``, ``versions``, ``tokens``."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": k, "text": c["text"], "finish_reason": c["finish_reason"],
                     "logprobs": ({"tokens": c["tokens"], "token_logprobs": c["log_probs"], "top_logprobs": None,
                                   "text_offset": []} if want_logprobs else None), **_served(c)}
                    for k, c in enumerate(choices)],
        "usage": _usage(len(prompt_ids), choices),
        "prompt_token_ids": prompt_ids, "hybridflow": {"session": session, "turns": turns},
    }


def stream_chunk(kind: str, response_id: str, model: str, delta: dict[str, Any] | str,
                 finish_reason: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One server-sent event's data: a chat chunk (``delta`` a message delta) or a completion chunk (text)."""
    if kind == "chat":
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    if extra:
        choice.update({k: v for k, v in extra.items()
                       if k in ("token_ids", "token_logprobs", "policy_versions", "raw_content")})
    chunk = {"id": response_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if extra:
        chunk.update({k: v for k, v in extra.items() if k in ("prompt_token_ids", "hybridflow", "usage")})
    return chunk
