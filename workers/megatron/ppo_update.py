"""The PPO update loop that the actor and the critic share: epochs x mini-batches, one optimizer step each."""

from __future__ import annotations

import math
from typing import Callable

import torch

from workers.data_proto import DataProto
from workers.megatron.engine import MegatronEngine, StepFn
from workers.megatron.micro_batches import PaddingStats
from workers.megatron.preflight import mini_batch_plan
from workers.policy_losses import LossNormalizer, valid_sequences

__all__ = ["normalizer_counts", "report_non_finite", "run_ppo_epochs", "token_share"]


def run_ppo_epochs(
    engine: MegatronEngine,
    data: DataProto,
    mini_batch_size: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    make_step: Callable[[LossNormalizer], StepFn],
    prefix: str,
) -> dict[str, list[float]]:
    """Metrics per mini-batch, named ``{prefix}/{statistic}``.

    Every statistic a step function returns must be its micro-batch's share
    of a mini-batch mean (divided by the global token or sequence count), so
    that summing over micro-batches and DP ranks gives the mini-batch value;
    a statistic named ``*_max`` is a maximum instead, and is maximized over them.
    """
    layout, replicas = engine.layout, engine.grid.data_replicas
    per_rank = mini_batch_plan(len(data) * replicas, mini_batch_size, replicas, engine.config.micro_batch_multiple)
    metrics: dict[str, list[float]] = {}
    engine.routing_metrics()  # from here on: the update's own passes
    engine.replay_metrics()
    for index, mini in enumerate(data.make_iterator(per_rank, epochs=epochs, shuffle=shuffle, seed=seed)):
        tokens, sequences = engine.dp_sum(normalizer_counts(mini.batch["response_mask"]))
        engine.zero_grad()
        # DDP averages gradients over DP ranks; the shares already add up to the mini-batch mean, so undo it
        # (the engine undoes the schedule's division by the number of micro-batches). layout.dp counts CP ranks
        # too: each holds part of every row's tokens, and the rows' gradient is the sum of their parts.
        stats = engine.run(mini, make_step(LossNormalizer(tokens, sequences)), forward_only=False, loss_scale=layout.dp)
        report_non_finite(engine, stats, prefix, index)
        step_metrics = engine.optimizer_step()
        step_metrics.update(engine.routing_metrics())
        step_metrics.update(engine.replay_metrics())  # the routers against a batch's routes, where it has them
        padding = PaddingStats(*engine.dp_sum([stats.padding.real, stats.padding.before, stats.padding.after]))
        step_metrics.update({"padding_fraction_before": padding.fraction_before,
                             "padding_fraction_after": padding.fraction_after})
        if stats:  # the last pipeline stage
            sums = sorted(k for k in stats[0] if not k.endswith("_max"))
            maxima = sorted(k for k in stats[0] if k.endswith("_max"))
            step_metrics.update(zip(sums, engine.dp_sum([sum(float(s[k]) for s in stats) for k in sums])))
            step_metrics.update(zip(maxima, engine.dp_max([max(float(s[k]) for s in stats) for k in maxima])))
        for key, value in step_metrics.items():
            metrics.setdefault(f"{prefix}/{key}", []).append(value)
    return metrics


def report_non_finite(engine: MegatronEngine, stats, prefix: str, mini_batch: int) -> None:
    """Print where a mini-batch's loss went non-finite: this rank's first micro-batch with a NaN or Inf
    statistic (the last pipeline stage's first TP rank of each DP rank reports its own). The optimizer step
    that follows is skipped on every rank (``MegatronEngine.optimizer_step``)."""
    if not stats or engine.groups.tp_rank != 0:
        return
    for micro, values in enumerate(stats):
        bad = {k: float(v) for k, v in values.items() if not math.isfinite(float(v))}
        if bad:
            shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
            print(f"[hybridflow] {prefix} update: mini-batch {mini_batch}: non-finite {shown} on DP rank "
                  f"{engine.groups.dp_rank}, micro-batch {micro}; the optimizer step is skipped on every rank",
                  flush=True)
            return


def normalizer_counts(response_mask: torch.Tensor) -> list[float]:
    """This rank's part of a mini-batch's ``LossNormalizer``: its response tokens and its sequences, to be
    summed over DP ranks. A row with no valid token is no sequence (the ``seq-mean-*`` modes average over
    sequences that have tokens), whichever micro-batch or rank holds it."""
    return [float(response_mask.sum()), float(valid_sequences(response_mask))]


def token_share(mask: torch.Tensor, normalizer: LossNormalizer) -> torch.Tensor:
    """The weight that turns a masked token mean over this micro-batch into its share of the mini-batch mean."""
    return mask.sum() / normalizer.tokens
