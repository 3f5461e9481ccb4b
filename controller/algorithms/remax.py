"""ReMax's hook: the greedy response's score is each prompt's baseline (Li et al. 2023)."""

from __future__ import annotations

from controller.algorithms.algorithm import RLAlgorithm, StepState, register_algorithm
from workers.data_proto import DataProto

__all__ = ["ReMax"]


@register_algorithm("remax", preset="remax")
class ReMax(RLAlgorithm):
    def after_scoring(self, ctx, state: StepState, batch: DataProto) -> DataProto:
        """One greedy response per prompt, scored; its score (and cost) repeated over the prompt's samples."""
        with state.timed("gen_baseline"):
            greedy = ctx.generate(state.prompts, state, sampling={"greedy": True, "n": 1, "seed": None},
                                      keep_metrics=False)
            scores = ctx.score(greedy).batch
        n = len(batch) // len(state.prompts)
        batch.batch["baseline_scores"] = scores["scores"].repeat_interleave(n)
        if "cost_scores" in scores:
            batch.batch["baseline_cost_scores"] = scores["cost_scores"].repeat_interleave(n)
        return batch
