"""A step's metrics under the field's names, from its batch and from the workers' update statistics."""

from __future__ import annotations

from typing import Any

import torch

from workers.data_proto import DataProto
from workers.policy_losses import masked_mean, zero_padding

__all__ = ["batch_metrics", "reduce_update_metrics"]


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()), f"{prefix}/min": float(values.min())}


def batch_metrics(batch: DataProto) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of a finished step's batch."""
    b = batch.batch
    mask = b["response_mask"].bool()
    response_length = b["response_mask"].sum(-1).float()
    prompt_length = b["attention_mask"][:, : b["prompts"].shape[1]].sum(-1).float()
    metrics = {
        **_stats("critic/score", b["scores"]),
        **_stats("critic/rewards", zero_padding(b["token_level_rewards"], mask).sum(-1)),
        **_stats("response_length", response_length),
        **_stats("prompt_length", prompt_length),
        "response_length/clip_ratio": float((response_length >= b["responses"].shape[1]).float().mean()),
    }
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        if key in b:
            values = b[key][mask]
            metrics.update(_stats(name, values) if values.numel() else {})
    if "entropys" in b:
        metrics["actor/entropy_rollout"] = float(masked_mean(b["entropys"], b["response_mask"]))
    return metrics


def reduce_update_metrics(replies: Any) -> dict[str, float]:
    """A role's update statistics (per mini-batch lists, one dict per answering replica) as step means."""
    first = replies[0] if isinstance(replies, list) else replies
    return {key: float(sum(values) / len(values)) for key, values in first.items() if values}
