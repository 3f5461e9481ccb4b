"""Micro-batches as the model sees them: which rows go together, rolled, trimmed, with their response positions.

RL batches are ``[left-padded prompt | right-padded response]`` at one width
for all rows. A micro-batch takes some of the rows, rolls each so its valid
tokens start at index 0 (see ``packing``) and cuts the columns to its own
longest row: padding is paid per micro-batch, not per batch.

Which rows go together:
- fixed: ``micro_batch_size`` rows at a time, in order;
- token budget (``max_tokens_per_micro_batch``, verl's ``ppo_max_token_len_per_gpu``):
  rows sorted by valid length, longest first, and cut greedily so that no
  micro-batch holds more than the budget in real tokens; rows of similar
  length land together, so there is little padding left to pay.

Every per-token output is read at ``response_index``: the rolled position
that predicts each response token (row i's prompt has p_i valid tokens, so
response token j is predicted at p_i - 1 + j). Positions of response padding
are clamped into the row and masked later. Outputs per row come back in the
micro-batches' order; ``original_order`` undoes the grouping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.megatron.packing import check_contiguous_rows, left_pad_counts, roll_rows
from workers.megatron.routing_replay import ROLLOUT_ROUTES, ROUTED_EXPERTS

__all__ = ["MicroBatch", "PaddingStats", "RunOutputs", "fixed_groups", "token_budget_groups", "build_micro_batch",
           "original_order"]


class MicroBatch(dict):
    """A micro-batch as the model sees it.

    Keys: ``input_ids`` (rolled, [B, W] with W its longest row), ``rows`` (the
    rows' indices in the batch), ``response_index`` [B, R] (rolled positions
    predicting the response tokens), ``routed_experts`` (a mixture of experts'
    routes to replay, [B, W, layers, k], rolled as the tokens, -1 past a row's
    end) and ``rollout_routed_experts`` (the rollout's, only compared) when the
    batch has them, and every other tensor of the original batch under its own
    name, unrolled and at full width.
    """


@dataclass(frozen=True)
class PaddingStats:
    """Token slots of one pass: real tokens, the batch's slots as it came, and the micro-batches' slots."""

    real: int
    before: int
    after: int

    @property
    def fraction_before(self) -> float:
        return 1.0 - self.real / self.before if self.before else 0.0

    @property
    def fraction_after(self) -> float:
        return 1.0 - self.real / self.after if self.after else 0.0


class RunOutputs(list):
    """The last stage's statistics of one pass, a dict per micro-batch (empty on other stages), with the pass's
    micro-batches and padding."""

    def __init__(self, stats: list[dict], micro: list[MicroBatch], padding: PaddingStats) -> None:
        super().__init__(stats or [])
        self.micro, self.padding = micro, padding

    def rows(self, key: str) -> torch.Tensor:
        """The per-row statistic ``key`` in the batch's row order."""
        return original_order([o[key] for o in self], self.micro)


def fixed_groups(rows: int, size: int) -> list[list[int]]:
    """``size`` rows at a time, in order; ``rows`` must be a multiple of ``size``."""
    if rows % size != 0:
        raise ValueError(
            f"{rows} sequences on this data-parallel rank do not divide into micro-batches of {size}; make the "
            "per-rank batch a multiple of micro_batch_size (or set max_tokens_per_micro_batch)"
        )
    return [list(range(start, start + size)) for start in range(0, rows, size)]


def token_budget_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch: at most ``max_tokens`` real tokens each, rows of similar length together.

    Longest first, cut greedily: the fewest micro-batches this order allows, each padded to its own
    first (longest) row. A row longer than the budget is an error: it would not fit anywhere.
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be a positive integer, got {max_tokens!r}")
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise ValueError(
            f"a sequence of {longest} tokens (prompt + response) exceeds max_tokens_per_micro_batch {max_tokens}; "
            f"raise it to at least {longest} (max_prompt_length + max_new_tokens fits every sequence)"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if not groups or total + lengths[i] > max_tokens:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += lengths[i]
    return groups


def build_micro_batch(batch: dict[str, torch.Tensor], rows: list[int], device: torch.device | None = None,
                      width_multiple: int = 1) -> MicroBatch:
    """The rows ``rows`` of ``batch`` (a mapping with input_ids, attention_mask, responses), on ``device``,
    trimmed to the longest row rounded up to a multiple of ``width_multiple`` (sequence parallelism splits
    the width over the TP ranks)."""
    index = torch.tensor(rows, dtype=torch.long)
    part = {key: value.index_select(0, index.to(value.device)).to(device) for key, value in batch.items()}
    index = index.to(device)
    mask = part["attention_mask"]
    check_contiguous_rows(mask, part.get("position_ids"))
    shift = left_pad_counts(mask)
    valid = mask.long().sum(-1)
    width = -(-max(int(valid.max()), 1) // width_multiple) * width_multiple
    response_length = part["responses"].shape[1]
    prompt_valid = mask[:, : mask.shape[1] - response_length].long().sum(-1)
    response_index = (prompt_valid.unsqueeze(1) - 1 + torch.arange(response_length, device=mask.device)).clamp(0, width - 1)
    mb = MicroBatch(part)
    ids = roll_rows(part["input_ids"], shift)[:, :width]
    if ids.shape[1] < width:  # rounded up past the batch's own width: padding on the right
        ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]))
    for key in (ROUTED_EXPERTS, ROLLOUT_ROUTES):
        if key in part:  # [B, S, layers, k]: rolled and trimmed with the tokens; no route past a row's end
            routes = roll_rows(part[key], shift)[:, :width]
            if routes.shape[1] < width:
                routes = torch.cat([routes, routes.new_full((len(routes), width - routes.shape[1], *routes.shape[2:]), -1)], 1)
            mb[key] = routes.contiguous()
    mb.update(input_ids=ids.contiguous(), rows=index,
              response_index=response_index)
    return mb


def original_order(values: list[torch.Tensor], micro: list[MicroBatch]) -> torch.Tensor:
    """Per-row outputs of the micro-batches (in their order) concatenated back in the batch's row order, on the host."""
    rows = torch.cat([mb["rows"] for mb in micro]).cpu()
    stacked = torch.cat(values).cpu()
    out = torch.empty_like(stacked)
    out[rows] = stacked
    return out


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` with the largest split in two (its longer rows first) until there are ``count``.

    Ranks whose passes meet in collectives (a mixture of experts' all-to-all spans data-parallel ranks) must
    run as many micro-batches as each other; a token budget may cut them differently.
    """
    groups = [list(g) for g in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        group = groups[largest]
        if len(group) < 2:
            raise ValueError(f"{sum(map(len, groups))} sequences on this data-parallel rank cannot fill {count} "
                             f"micro-batches, the most another rank of its expert-parallel group runs")
        half = (len(group) + 1) // 2
        groups[largest:largest + 1] = [group[:half], group[half:]]
    return groups
