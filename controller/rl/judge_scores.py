"""A generative judge's scores in the step's (``reward.judge``): the score phase's first call after the reward.

    reward: {fn: null, judge: {model_path: ..., template: ..., parser: yes_no}}         # the judge alone
    reward: {fn: arithmetic_answer, judge: {model_path: ..., weight: 0.5}}             # rule + 0.5 x judge
    reward: {fn: auto, judge: {model_path: ..., data_sources: [writing]}}              # routed by data_source

- Without ``data_sources`` every sample is judged: its score is the rule reward's (0 where there is none) plus
  ``weight`` x the judge's.
- With ``data_sources`` only those samples go to the judge, and their score is ``weight`` x the judge's; the rule
  reward scores the others (and skips these: ``RuleReward(skip_data_sources=...)``).

The judge's own columns (``workers.reward.judge.JUDGE_COLUMNS``) and ``judged`` (1 where the judge scored the
sample) join the batch; ``controller.rl.step_metrics.batch_metrics`` reports them as ``reward/judge/*``.
"""

from __future__ import annotations

import torch

from workers.data_proto import DataProto
from workers.reward.judge import JUDGE_COLUMNS
from workers.reward.rule_reward import last_token_scores

__all__ = ["judge_scores"]


def judge_scores(group, batch: DataProto, scores: DataProto | None, *, weight: float,
                 data_sources: tuple[str, ...] = ()) -> DataProto:
    """``scores`` (None: there is no other reward) with the judge's (``group``: the judge's worker group)."""
    rows = len(batch)
    if data_sources:
        sources = batch.non_tensor_batch.get("data_source")
        judged = torch.tensor([sources is not None and s in data_sources for s in sources] if sources is not None
                              else [False] * rows)
    else:
        judged = torch.ones(rows, dtype=torch.bool)
    mask = batch.batch["response_mask"]
    base = scores.batch["scores"].float() if scores is not None else torch.zeros(rows)
    columns = {name: torch.zeros(rows) for name in JUDGE_COLUMNS}
    if judged.any():
        picked = judged.nonzero().flatten().tolist()
        out = group.compute_reward(batch if len(picked) == rows else batch[picked])
        for name in JUDGE_COLUMNS:
            columns[name][judged] = out.batch[name].float()
    judge = weight * columns["judge_scores"]
    total = torch.where(judged, judge if data_sources else base + judge, base)
    merged = dict(scores.batch.items()) if scores is not None else {}
    merged.update({"scores": total, "token_level_scores": last_token_scores(total, mask), **columns,
                   "judged": judged.float()})
    return DataProto(merged)
