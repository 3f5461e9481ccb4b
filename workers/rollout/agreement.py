"""How far the rollout's log-probs are from the actor's, and which of the two the PPO ratio uses.

The rollout engine and the training engine compute the same distribution
with different kernels (and, on GPU, often different precision); their gap
on the sampled tokens is the first thing to look at when PPO misbehaves.
"""

from __future__ import annotations

import torch

from workers.data_proto import DataProto

__all__ = ["OLD_LOG_PROB_SOURCES", "logprob_agreement", "use_old_log_probs"]

OLD_LOG_PROB_SOURCES = ("recompute", "rollout")


def logprob_agreement(rollout_log_probs: torch.Tensor, log_probs: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """``rollout/logprob_diff_max`` and ``rollout/logprob_diff_mean``: |rollout - actor| over response tokens."""
    mask = response_mask.bool()
    if rollout_log_probs.shape != log_probs.shape or log_probs.shape != mask.shape:
        raise ValueError(f"shapes differ: rollout {tuple(rollout_log_probs.shape)}, actor {tuple(log_probs.shape)}, "
                         f"mask {tuple(mask.shape)}")
    diff = (rollout_log_probs.float() - log_probs.float()).abs()[mask]
    if diff.numel() == 0:
        return {"rollout/logprob_diff_max": 0.0, "rollout/logprob_diff_mean": 0.0}
    return {"rollout/logprob_diff_max": float(diff.max()), "rollout/logprob_diff_mean": float(diff.mean())}


def use_old_log_probs(batch: DataProto, source: str = "recompute") -> DataProto:
    """A copy of ``batch`` whose ``old_log_probs`` come from ``source``, for the PPO ratio.

    "recompute" (the default) keeps the actor's ``compute_log_prob`` result,
    which the batch must already hold; "rollout" uses the engine's
    ``rollout_log_probs`` and saves that forward pass.
    """
    if source not in OLD_LOG_PROB_SOURCES:
        raise ValueError(f"old log-prob source {source!r} is not one of {OLD_LOG_PROB_SOURCES}")
    key = "old_log_probs" if source == "recompute" else "rollout_log_probs"
    if key not in batch.batch:
        raise KeyError(f"old log-prob source {source!r} needs {key!r} in the batch; it has {sorted(batch.batch)}")
    return DataProto({**batch.batch, "old_log_probs": batch.batch[key]}, batch.non_tensor_batch, batch.meta_info)
