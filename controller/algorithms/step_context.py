"""StepContext: what an algorithm's hooks see of the trainer during one step, and nothing more.

    def after_scoring(self, ctx, state, batch):
        more = ctx.generate_and_score(ctx.loader.next_batch(), state, round_index=1)   # DAPO
        greedy = ctx.generate(state.prompts, state, sampling={"greedy": True, "n": 1})  # ReMax
        scores = ctx.score(greedy)

A hook reads settings (``step``, ``mode``, ``ppo``, ``max_response_length``, ``pad_token_id``),
draws prompts (``loader``), generates and scores, and calls any role (``groups``, read-only). It
cannot reach the trainer's pools, specs, checkpoints or logger, so an algorithm cannot depend on
them, and a test can hand a hook a context of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["StepContext"]


@dataclass(frozen=True)
class StepContext:
    step: int  # the trainer's global step (updates taken so far)
    mode: str  # the schedule: "sync", "one_step_off" or "async"
    ppo: Any  # the actor's PPOActorConfig
    max_response_length: int | None  # a response's (a conversation's, for agent rollouts) token limit
    pad_token_id: int | None
    loader: Any  # the PromptLoader the step draws prompts from
    groups: Mapping[str, Any]  # role -> its WorkerGroup
    generate: Callable[..., Any]  # (prompts, state, sampling, keep_metrics=True) -> the rollout's batch
    generate_and_score: Callable[..., Any]  # (prompts, state, round_index=0) -> a scored batch
    score: Callable[[Any], Any]  # (batch) -> token_level_scores and scores

    @classmethod
    def of(cls, trainer: Any) -> "StepContext":
        """The context of ``trainer``'s current step."""
        return cls(step=trainer.global_step, mode=trainer.mode, ppo=trainer.ppo,
                   max_response_length=trainer.max_response_length, pad_token_id=trainer.pad_token_id,
                   loader=trainer.loader, groups=MappingProxyType(dict(trainer.groups)), generate=trainer.generate,
                   generate_and_score=trainer.generate_and_score, score=trainer.score)
