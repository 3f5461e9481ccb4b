"""RuleReward: scores decoded rollouts with a rule-based reward function.

Each rank of the group gets an equal share of the batch (DP_COMPUTE_PROTO),
decodes prompt and response of every sample and calls the reward function
on them; see ``workers.reward.functions`` for the function's signature.
Up to ``max_concurrency`` samples are scored at once, on threads: a reward
that waits (on a sandboxed program, a judge's endpoint) overlaps its waits.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from workers.base_worker import BaseWorker
from workers.data_proto import DataProto
from workers.deadline_threads import DeadlineThreads
from workers.dispatch import Dispatch
from workers.multimodal import MULTI_MODAL_INPUTS
from workers.register import register
from workers.reward.functions import REWARD_FUNCTIONS, RewardFn
from workers.reward.router import DATA_SOURCE_SCORERS, resolve_scorer, score_by_data_source
from workers.sandbox import SANDBOX_REWARDS, set_default_isolation

__all__ = ["RewardFunctionError", "RuleReward", "last_token_scores"]

REQUIRED_KEYS = ("prompts", "responses", "attention_mask", "response_mask")
SANDBOX_CONCURRENCY = 8  # samples scored at once by a reward that runs code in the sandbox
TIMEOUT_SCORE = 0.0  # the score of a sample whose reward call passed its timeout
RUNS_CODE = frozenset(REWARD_FUNCTIONS[name] for name in SANDBOX_REWARDS)  # the built-ins that run code
MAX_ABANDONED_CALLS = 256  # reward calls past their timeout still running: more is an error (the function hangs)


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something other than a finite number, on one sample."""


def last_token_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] float32: ``scores[i]`` on row i's last valid response token, 0 elsewhere.

    A row without valid response tokens gets all zeros.
    """
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1)  # -1: no valid token
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = (last >= 0).nonzero().flatten()
    out[rows, last[rows]] = scores.to(torch.float32)[rows]
    return out


def final_reply(messages) -> str:
    """The last assistant message's text of a conversation ("" when the model never spoke)."""
    return next((m.get("content") or "" for m in reversed(list(messages)) if m.get("role") == "assistant"), "")


def _function_name(fn: Callable, spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    qualname = getattr(fn, "__qualname__", None)
    return f"{fn.__module__}:{qualname}" if qualname and getattr(fn, "__module__", None) else repr(fn)


class RuleReward(BaseWorker):
    """A reward worker around a Python function of (prompt, response, ground truth, extra fields).

    ``reward_fn`` is a callable, a built-in name (``REWARD_FUNCTIONS``), an
    import path ``"package.module:function"`` or ``"auto"`` (a scorer per
    sample's ``data_source``, ``workers.reward.router``); ``reward_kwargs``
    are passed to every call as keyword arguments. ``max_concurrency``:
    samples scored at once (threads; 1: one after another, in order, on the
    calling thread); None: ``SANDBOX_CONCURRENCY`` for the built-in rewards
    that run code in the sandbox, else 1.
    ``sandbox_isolation``: the job's ``sandbox.isolation``, this process's
    default for sandboxed code (None: the sandbox's own default).
    ``timeout_s``: each sample's call at most (None: no limit); one past it
    scores ``TIMEOUT_SCORE`` and is marked in ``reward_timed_out``, and the
    batch goes on. ``skip_data_sources``: rows another role scores (a
    generative judge's ``data_sources``): 0 here, the function not called.
    """

    def __init__(
        self,
        tokenizer_path: str,
        reward_fn: str | RewardFn = "arithmetic_answer",
        reward_kwargs: dict[str, Any] | None = None,
        max_concurrency: int | None = None,
        sandbox_isolation: str | None = None,
        timeout_s: float | None = None,
        skip_data_sources: tuple[str, ...] = (),
    ) -> None:
        from transformers import AutoTokenizer

        if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                            or max_concurrency < 1):
            raise ValueError(f"max_concurrency must be a positive integer or None, got {max_concurrency!r}")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        set_default_isolation(sandbox_isolation)
        self.reward_fn = resolve_scorer(reward_fn)
        self.reward_fn_name = _function_name(self.reward_fn, reward_fn)
        self.reward_kwargs = dict(reward_kwargs or {})
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.skip_data_sources = frozenset(skip_data_sources)  # scored by another role (a judge): 0 here, no call
        self._threads: dict[int, DeadlineThreads] = {}  # by concurrency, kept across calls (hung threads count)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_reward(self, data: DataProto) -> DataProto:
        """``scores`` [B], ``token_level_scores`` [B, R] (the score on the last valid response token) and
        with ``timeout_s``, ``reward_timed_out`` [B] (1.0 where the call passed it)."""
        missing = [key for key in REQUIRED_KEYS if key not in data.batch]
        if missing:
            raise KeyError(f"compute_reward needs batch tensors {list(REQUIRED_KEYS)}; missing {missing}")
        prompts, responses = data.batch["prompts"], data.batch["responses"]
        prompt_mask = data.batch["attention_mask"][:, : prompts.shape[1]].bool()
        response_mask = data.batch["response_mask"]
        prompt_texts = self._decode(prompts, prompt_mask)
        response_texts = self._decode(responses, response_mask.bool())
        conversations = data.non_tensor_batch.get("agent_messages")
        if conversations is not None:  # a multi-turn rollout: the answer is the model's last turn
            response_texts = [final_reply(messages) for messages in conversations]

        fields = data.non_tensor_batch
        ground_truth = fields.get("ground_truth")
        offset = self.rank * len(data)  # DP_COMPUTE_PROTO hands every rank an equal chunk

        def score(i: int) -> float:
            extra = {key: values[i] for key, values in fields.items() if key not in ("ground_truth", MULTI_MODAL_INPUTS)}
            if extra.get("data_source") in self.skip_data_sources:
                return 0.0
            truth = None if ground_truth is None else ground_truth[i]
            return self._score(offset + i, prompt_texts[i], response_texts[i], truth, extra)

        concurrency = self._concurrency(fields.get("data_source"))
        timed_out = [False] * len(data)
        if self.timeout_s is not None:
            values, timed_out = self._score_by_deadline(score, len(data), concurrency)
        elif concurrency == 1 or len(data) < 2:
            values = [score(i) for i in range(len(data))]
        else:  # every sample's score is awaited; the first failure (by sample) is the one raised
            with ThreadPoolExecutor(min(concurrency, len(data)), thread_name_prefix="reward") as pool:
                futures = [pool.submit(score, i) for i in range(len(data))]
                values = [future.result() for future in futures]
        scores = torch.tensor(values, dtype=torch.float32).reshape(len(data))
        out = {"token_level_scores": last_token_scores(scores, response_mask), "scores": scores}
        if self.timeout_s is not None:
            out["reward_timed_out"] = torch.tensor(timed_out, dtype=torch.float32).reshape(len(data))
        return DataProto(out)

    def _score_by_deadline(self, score: Callable[[int], float], count: int,
                           concurrency: int) -> tuple[list[float], list[bool]]:
        """Each sample's score on a daemon thread of its own, ``concurrency`` at once, each given ``timeout_s``:
        a call past it scores ``TIMEOUT_SCORE`` and is marked, and its thread is abandoned (it ends when the
        call returns; more than ``MAX_ABANDONED_CALLS`` still running is an error). The first failure (by
        sample) is raised."""
        if concurrency not in self._threads:
            self._threads[concurrency] = DeadlineThreads(concurrency, "hybridflow-reward", MAX_ABANDONED_CALLS)
        threads = self._threads[concurrency]
        calls = [(threads.submit(score, i, timeout_s=self.timeout_s), time.monotonic() + self.timeout_s)
                 for i in range(count)]
        values, timed_out = [], []
        for future, deadline in calls:
            try:
                if future is None:  # every thread is held by a call past its deadline: not started
                    raise FutureTimeout
                values.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
                timed_out.append(False)
            except FutureTimeout:
                values.append(TIMEOUT_SCORE)
                timed_out.append(True)
        return values, timed_out

    def _concurrency(self, data_sources) -> int:
        """``max_concurrency``, else SANDBOX_CONCURRENCY where this batch's scorer runs code, else 1."""
        if self.max_concurrency is not None:
            return self.max_concurrency
        if self.reward_fn is score_by_data_source and data_sources is not None:
            scorers = {DATA_SOURCE_SCORERS.get(source) for source in set(list(data_sources))}
        else:
            scorers = {self.reward_fn}
        return SANDBOX_CONCURRENCY if scorers & RUNS_CODE else 1

    def _decode(self, tokens: torch.Tensor, mask: torch.Tensor) -> list[str]:
        rows = [row[keep].tolist() for row, keep in zip(tokens, mask)]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    def _score(self, sample: int, prompt: str, response: str, ground_truth: Any, extra: dict) -> float:
        try:
            value = self.reward_fn(prompt, response, ground_truth, extra, **self.reward_kwargs)
        except Exception as exc:
            raise RewardFunctionError(
                f"reward function {self.reward_fn_name} raised on sample {sample} "
                f"({type(exc).__name__}: {exc}); response: {response[:200]!r}"
            ) from exc
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardFunctionError(
                f"reward function {self.reward_fn_name} returned {value!r} ({type(value).__name__}) on sample "
                f"{sample}; a reward must be a finite int or float (bools are refused: return float(...))"
            )
        return float(value)
