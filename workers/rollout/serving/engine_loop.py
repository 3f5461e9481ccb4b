"""Continuous batching over requests that arrive one at a time: a vLLM engine stepped by one thread.

Requests come from any thread (``submit``, ``abort``); the thread that calls ``run`` (the rollout worker's
own) adds them to vLLM's ``LLMEngine`` between steps and steps it while any is unfinished, handing each step's
new tokens to the request's callback as they are sampled (``ServedTokens``: the ids, their log-probs and the
policy version that sampled them).

Weights change between steps only (``update``: run on the stepping thread):

- ``pause``: the requests in flight stop where they are, the weights change, and they go on on the new
  weights; their tokens say which version sampled each;
- ``finish``: no request is admitted until those in flight have finished on the old weights.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["UPDATE_POLICIES", "EngineLoop", "ServedTokens", "TakenUpdate"]

UPDATE_POLICIES = ("pause", "finish")


@dataclass
class ServedTokens:
    """New tokens of one request: ids, their log-probs and policy versions; ``finish_reason`` on the last."""

    token_ids: list[int]
    log_probs: list[float]
    versions: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort" once the request is done
    prompt_ids: list[int] = field(default_factory=list)  # on the first event only


@dataclass
class TakenUpdate:
    """What a weight update did, as the stepping thread saw it: ``load``'s answer; the requests in flight when the
    weights changed (``pause``: they go on with the new ones; ``finish``: none, by construction); the requests in
    flight when the stepping thread first saw the update that finished on the old weights before it was taken;
    and how long the update waited (seconds from ``update`` to the weights in)."""

    result: Any
    paused: int
    finished_first: int
    wait_s: float


@dataclass
class _PendingUpdate:
    load: Callable[[], Any]
    policy: str
    asked_at: float
    done: threading.Event = field(default_factory=threading.Event)
    in_flight_when_seen: set[str] | None = None
    taken: TakenUpdate | BaseException | None = None


class EngineLoop:
    """``engine``: a vLLM ``LLMEngine``; ``make_params(sampling: dict) -> SamplingParams``; ``lora_request()``:
    the LoRA adapter a new request is served with (None: the base), read as each request is added, since a
    weight update of a LoRA actor served unmerged registers a new adapter and deletes the one before."""

    def __init__(self, engine, make_params: Callable[[dict], Any], lora_request: Callable[[], Any] | None = None,
                 version: int = 0, idle_wait_s: float = 0.05) -> None:
        self.engine, self.make_params = engine, make_params
        self.lora_request = lora_request or (lambda: None)
        self.version = version
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[str, Callable[[ServedTokens], None]] = {}
        self._started: set[str] = set()
        self._held: list[tuple] = []  # requests waiting for a finishing update
        self._updates: list[_PendingUpdate] = []
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.stats = {"requests": 0, "tokens": 0, "steps": 0, "aborted": 0, "updates": 0}
        self.max_model_len = int(engine.vllm_config.model_config.max_model_len)  # prompt and completion

    # ------------------------------------------------------------------ any thread
    def submit(self, prompt_ids: list[int], sampling: dict, on_tokens: Callable[[ServedTokens], None]) -> str:
        """Queue a request; ``on_tokens`` gets its tokens, from the stepping thread, as they come."""
        request_id = f"served-{next(self._ids)}"
        self._inbox.put(("add", request_id, list(prompt_ids), sampling, on_tokens))
        return request_id

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def update(self, load: Callable[[], Any], policy: str = "pause", timeout_s: float | None = None) -> TakenUpdate:
        """Run ``load`` (new weights) on the stepping thread between steps, by ``policy``, and wait for it; the
        version goes up by one. Call it from another thread than ``run``'s."""
        if policy not in UPDATE_POLICIES:
            raise ValueError(f"weight update policy {policy!r} is not one of {UPDATE_POLICIES}")
        pending = _PendingUpdate(load, policy, time.perf_counter())
        self._updates.append(pending)
        self._inbox.put(("wake",))
        if not pending.done.wait(timeout_s):
            raise TimeoutError(f"the engine loop did not take the weight update within {timeout_s} s")
        if isinstance(pending.taken, BaseException):
            raise pending.taken
        return pending.taken

    def stop(self) -> None:
        """End ``run`` once the requests in flight have finished."""
        self._stop.set()
        self._inbox.put(("wake",))

    @property
    def in_flight(self) -> int:
        return len(self._callbacks)

    # ------------------------------------------------------------------ the stepping thread
    def run(self) -> dict[str, Any]:
        """Step until ``stop`` and nothing is in flight; the loop's counts and time."""
        start = time.perf_counter()
        while True:
            self._drain(block=not self._callbacks and not self._updates)
            self._apply_updates()
            if self._callbacks:
                self._step()
            elif self._stop.is_set() and self._inbox.empty() and not self._held:
                break
        return {**self.stats, "seconds": time.perf_counter() - start}

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            if any(pending.policy == "finish" for pending in self._updates):
                self._held.append(item)  # after the update, on the new weights
                return
            _, request_id, prompt_ids, sampling, on_tokens = item
            self._callbacks[request_id] = on_tokens
            try:
                self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, self.make_params(sampling),
                                        lora_request=self.lora_request())
            except Exception as exc:  # a request vLLM refuses (too long, bad sampling): it alone ends
                del self._callbacks[request_id]
                on_tokens(ServedTokens([], [], [], finish_reason=f"error: {exc}", prompt_ids=prompt_ids))
                return
            self.stats["requests"] += 1
        elif kind == "abort":
            request_id = item[1]
            if request_id in self._callbacks:
                self.engine.abort_request([request_id])
                self._callbacks.pop(request_id)(ServedTokens([], [], [], finish_reason="abort"))
                self.stats["aborted"] += 1

    def _apply_updates(self) -> None:
        for pending in self._updates:
            if pending.in_flight_when_seen is None:
                pending.in_flight_when_seen = set(self._callbacks)
        while self._updates:
            pending = self._updates[0]
            if pending.policy == "finish" and self._callbacks:
                return  # the requests in flight finish first
            try:
                result = pending.load()
                self.version += 1
                self.stats["updates"] += 1
                pending.taken = TakenUpdate(result, paused=len(self._callbacks),
                                            finished_first=len(pending.in_flight_when_seen - set(self._callbacks)),
                                            wait_s=time.perf_counter() - pending.asked_at)
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                pending.taken = exc
            self._updates.pop(0)
            pending.done.set()
        held, self._held = self._held, []
        for item in held:
            self._handle(item)

    def _step(self) -> None:
        outputs = self.engine.step()
        self.stats["steps"] += 1
        for output in outputs:
            callback = self._callbacks.get(output.request_id)
            if callback is None:
                continue
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            log_probs = [step[token].logprob for token, step in zip(ids, sample.logprobs or [])]
            first = output.request_id not in self._started
            self._started.add(output.request_id)
            reason = None
            if output.finished:
                reason = "stop" if sample.finish_reason == "stop" else "length"
                del self._callbacks[output.request_id]
                self._started.discard(output.request_id)
            self.stats["tokens"] += len(ids)
            callback(ServedTokens(ids, log_probs, [self.version] * len(ids), reason,
                                  list(output.prompt_token_ids or []) if first else []))
