"""RolloutSource: what a rollout schedule sees of the trainer during one step, and nothing more.

A schedule (``controller.rl.schedules``) decides when a step's batch is generated and with which
weights. It draws prompts, sends generation calls to the rollout's group, moves the actor's weights
to a rollout on its own pool, and scores what comes back; it reads the policy version, the seed, the
batch size and the sampling settings. It cannot reach the trainer's pools, specs, checkpoints or
the other roles, and a test can hand a schedule a source of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

__all__ = ["RolloutSource"]


@dataclass(frozen=True)
class RolloutSource:
    version: int  # the trainer's global step: the version of the policy's weights now
    seed: int  # the trainer's seed, which every generation seed derives from
    batch_size: int  # prompts per step
    sampling: Any  # the rollout's SamplingConfig
    pad_token_id: int | None
    next_prompts: Callable[[Any], Any]  # (state) -> the loader's next batch, through before_generation
    generate_and_score: Callable[..., Any]  # (prompts, state) -> a scored batch, generated now
    score: Callable[[Any], Any]  # (batch) -> token_level_scores and scores
    submit: Callable[[str, Any], Future]  # (the rollout group's method, data) -> its result's future
    # (receive=None) the actor's weights to the rollout's pool, when its copy is stale; the transfer's metrics.
    # receive: how the rollout's ranks take them (default: a call to its group; a serving rollout's replicas)
    sync_weights: Callable[..., dict[str, float]]
    record_rollout_metrics: Callable[[Any, dict[str, Any]], None]  # (state, a generation's metrics)
