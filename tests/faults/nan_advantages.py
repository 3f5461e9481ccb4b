"""GRPO whose advantages turn NaN on one token of the batch's last sample (the last DP rank's last
micro-batch) at the steps ``$HYBRIDFLOW_TEST_NAN_STEPS`` lists (comma-separated, numbered from 1 as the
console and the metrics number them): a non-finite loss on one micro-batch of one rank, as a bad sample or an
overflow gives one."""

import os

from controller.algorithms import RLAlgorithm


class NaNAdvantages(RLAlgorithm):
    preset = "grpo"

    def advantages(self, ctx, state, batch):
        batch = super().advantages(ctx, state, batch)
        steps = {int(s) for s in os.environ.get("HYBRIDFLOW_TEST_NAN_STEPS", "").split(",") if s.strip()}
        if state.step + 1 in steps:
            row = len(batch) - 1
            first = int(batch.batch["response_mask"][row].nonzero()[0])
            batch.batch["advantages"][row, first] = float("nan")
        return batch
