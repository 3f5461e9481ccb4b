"""Validation: greedy responses to every held-out prompt, scored as the step scores them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["validate"]


def validate(rollout_client: Any, val_loader: Any, score: Callable[[Any], Any], step: int) -> dict[str, float]:
    """``val/reward/mean`` and ``val/response_length/mean`` over ``val_loader``'s batches (and an agent's
    ``val/agent/tool_calls/mean``), generated greedily through ``rollout_client`` on the policy's weights at
    ``step`` (a served stream takes them in flight) and scored by ``score``."""
    scores, lengths, calls = [], [], []
    rollout_client.weights_for_validation(step)
    for prompts in val_loader.all_batches():
        out = rollout_client.responses(prompts, {"greedy": True, "n": 1, "seed": None}, training=False)
        scores.append(score(out).batch["scores"])
        lengths.append(out.batch["response_mask"].sum(-1).float())
        if "agent_tool_calls" in out.non_tensor_batch:  # an agent rollout: the tool calls of each sample
            calls += [float(c) for c in out.non_tensor_batch["agent_tool_calls"]]
    result = {"val/reward/mean": float(torch.cat(scores).mean()),
              "val/response_length/mean": float(torch.cat(lengths).mean())}
    if calls:
        result["val/agent/tool_calls/mean"] = sum(calls) / len(calls)
    return result
