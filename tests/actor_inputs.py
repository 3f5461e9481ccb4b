"""What the actor-update programs share: PPO inputs beside a batch, and an actor's whole weights after training."""

import torch

from workers import DataProto


def with_ppo_inputs(batch: DataProto, seed: int, old_log_probs: bool = True, rollout_log_probs: bool = False) -> DataProto:
    """``batch`` with random advantages and, as asked, old / rollout log-probs, each zero off the response mask."""
    g = torch.Generator().manual_seed(seed)
    mask = batch.batch["response_mask"]
    extra = {"advantages": torch.randn(mask.shape, generator=g) * mask}
    if old_log_probs:
        extra["old_log_probs"] = (-5 + torch.randn(mask.shape, generator=g)) * mask
    if rollout_log_probs:
        extra["rollout_log_probs"] = (-4 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    return batch.union(DataProto(extra))


def whole_weights(actor) -> dict[str, torch.Tensor]:
    """An actor group's parameters, all of them on one rank: resharded to generation TP1 x PP1 and back."""
    actor.to_generation(1, 1)
    weights = actor.generation_weights()[0]
    actor.to_training()
    return weights
