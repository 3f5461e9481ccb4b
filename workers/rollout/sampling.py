"""Sampling settings shared by every rollout engine, checked before any generation starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["SamplingConfig"]


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are drawn.

    ``temperature`` 0 (or ``greedy=True``) means greedy decoding, as ReMax's
    baseline needs. ``n`` samples per prompt serve GRPO and RLOO. With
    ``seed`` set, request ``i`` (its global index in the batch) and sample
    ``j`` draw from the seed ``seed + i * n + j``, so the same seed gives the
    same samples however the batch is split across generation replicas.
    Log-probs returned with the samples are those of the processed
    distribution: logits divided by the temperature (and restricted by top-k
    / top-p when those are set), which is what the PPO ratio compares against.
    """

    max_new_tokens: int = 32  # response tokens at most (an agent rollout: per model turn)
    temperature: float = 1.0  # logits are divided by it before sampling; 0: greedy
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this much probability; 1: all
    top_k: int = -1  # -1: all tokens
    n: int = 1  # responses sampled per prompt (GRPO, RLOO need >= 2)
    greedy: bool = False  # argmax decoding whatever the temperature (ReMax's baseline)
    # request i, sample j draws from seed + i * n + j; None: unseeded. hybridflow train sets it at each
    # step from trainer.seed
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings: a response ends when it produces one
    ignore_eos: bool = False  # generate past EOS, up to max_new_tokens

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            problems.append(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k != -1 and self.top_k < 1:
            problems.append(f"top_k must be -1 (all tokens) or >= 1, got {self.top_k!r}")
        if self.n < 1:
            problems.append(f"n (samples per prompt) must be >= 1, got {self.n!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {self.stop!r}")
        if problems:
            raise ValueError("invalid sampling settings: " + "; ".join(problems))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature that the returned log-probs (and the actor's) divide logits by."""
        return 1.0 if self.is_greedy else self.temperature

    def request_seed(self, index: int, sample: int) -> int | None:
        return None if self.seed is None else self.seed + index * self.n + sample

    def updated(self, overrides: dict[str, Any] | None) -> "SamplingConfig":
        """A copy with ``overrides`` (e.g. a batch's ``meta_info['sampling']``) applied and checked."""
        if not overrides:
            return self
        unknown = sorted(set(overrides) - set(self.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown sampling settings {unknown}; valid: {sorted(self.__dataclass_fields__)}")
        return replace(self, **overrides)
