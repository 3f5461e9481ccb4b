"""How far the rollout's log-probs are from the actor's, and where the PPO ratio's old log-probs come from.

The rollout engine and the training engine compute the same distribution
with different kernels (and, on GPU, often different precision); their gap
on the sampled tokens is the first thing to look at when PPO misbehaves.

Sources of the old log-probs: "recompute" (a forward pass of the actor
before the update), "rollout" (the engine's own), or "auto": when the
update is provably on-policy (one PPO epoch, the step's sequences in one
mini-batch, nothing before the update reading them), the update's own
forward, detached, is the old policy, and the separate pass is skipped;
otherwise "recompute".
"""

from __future__ import annotations

import torch

from workers.data_proto import DataProto

__all__ = ["OLD_LOG_PROB_SOURCES", "logprob_agreement", "old_log_probs_from_update", "use_old_log_probs"]

OLD_LOG_PROB_SOURCES = ("auto", "recompute", "rollout")


def old_log_probs_from_update(source: str, ppo_epochs: int, ppo_mini_batch_size: int, sequences_per_step: int,
                              read_before_update: bool) -> bool:
    """Whether the update's own forward can give the old log-probs (and the separate pass be skipped).

    Only for ``source`` "auto", and only when the update is provably on-policy: a single optimizer step
    (one epoch over one mini-batch holding the step's ``sequences_per_step`` sequences) taken from the
    weights that generated the batch, and nothing before the update (``read_before_update``: a KL penalty
    in the reward, say) needing the old log-probs.
    """
    if source not in OLD_LOG_PROB_SOURCES:
        raise ValueError(f"old log-prob source {source!r} is not one of {OLD_LOG_PROB_SOURCES}")
    return (source == "auto" and ppo_epochs == 1 and ppo_mini_batch_size == sequences_per_step
            and not read_before_update)


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

    "recompute" (and "auto" when it did not take them from the update) keeps the actor's
    ``compute_log_prob`` result, which the batch must already hold; "rollout" uses the engine's
    ``rollout_log_probs``.
    """
    if source not in OLD_LOG_PROB_SOURCES:
        raise ValueError(f"old log-prob source {source!r} is not one of {OLD_LOG_PROB_SOURCES}")
    key = "rollout_log_probs" if source == "rollout" else "old_log_probs"
    if key not in batch.batch:
        raise KeyError(f"old log-prob source {source!r} needs {key!r} in the batch; it has {sorted(batch.batch)}")
    return DataProto({**batch.batch, "old_log_probs": batch.batch[key]}, batch.non_tensor_batch, batch.meta_info)
