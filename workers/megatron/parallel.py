"""A training grid's process groups, built explicitly and handed to megatron-core.

megatron can keep one TP/PP/DP grid in module globals (``parallel_state``);
this project never sets or reads them. Each engine builds its own grid over
its pool's ranks (``training_groups``) and passes it to every megatron
object that communicates (the GPTModel, DDP, the optimizer, the schedule,
the gradient finalizer) as a ``ProcessGroupCollection``. So two training
grids live in one process: an actor at TP2 and a reward model at TP1 on the
same two processes each have their own groups. Groups are created with
local synchronization (``hybridengine.parallel.process_groups``), so only the pool's
members take part, and a rank set two grids share is one group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hybridengine.parallel.layout import ParallelLayout
from hybridengine.parallel.process_groups import group_ranks, subgroup
from workers.megatron.megatron_compat import ensure_scratch_buffer, prepare_megatron

__all__ = ["MegatronGroups", "ensure_rng_states", "training_groups"]


@dataclass(frozen=True)
class MegatronGroups:
    """One process's place in a training grid, and the grid's groups (``collection`` for megatron)."""

    layout: ParallelLayout
    ranks: tuple[int, ...]  # the pool's global ranks; grid rank i is global rank ranks[i]
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int  # the expert grid (layout.expert_coordinate); 0 and the dense groups for a dense grid
    etp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    pool_group: Any  # every rank of the grid
    collection: Any  # megatron's ProcessGroupCollection
    ep_group: Any = None  # the expert-parallel group (whole experts)
    etp_group: Any = None  # the expert-tensor-parallel group (one expert's shards)
    edp_group: Any = None  # the replicas of this rank's expert shards
    cp_rank: int = 0  # context parallelism: which chunks of each sequence this rank holds
    cp_group: Any = None  # the ranks that split each sequence of the same rows (this rank alone at CP 1)
    data_group: Any = None  # the ranks that take other rows at this CP rank: where sums over a batch's rows reduce

    @property
    def grid_rank(self) -> int:
        """This process's rank within the grid (0 .. layout.world_size - 1)."""
        return self.layout.rank_of(self.tp_rank, self.pp_rank, self.dp_rank)

    @property
    def is_first(self) -> bool:
        """Grid rank 0: the one that writes what the whole grid writes once."""
        return self.grid_rank == 0


def ensure_rng_states(tp_rank: int, seed: int = 1) -> None:
    """Seed megatron's named RNG states (which its attention forks into) when no grid in this process has:
    a rollout on a pool of its own builds no training grid."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    if not get_cuda_rng_tracker().get_states():
        model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)


def _mine(groups: list[list[int]], grid_rank: int, ranks: tuple[int, ...]) -> Any:
    own = next(group for group in groups if grid_rank in group)
    return subgroup([ranks[r] for r in own])


def _embedding_groups(layout: ParallelLayout) -> list[list[int]]:
    """megatron's embedding group: the first and last stage of each pipeline (a rank alone at PP1).

    It all-reduces the tied embedding's gradient between the input embedding (first stage) and the
    output layer (last stage).
    """
    return [sorted({group[0], group[-1]}) for group in layout.pp_groups()]


def training_groups(layout: ParallelLayout, seed: int, process_group: Any = None) -> MegatronGroups:
    """This rank's groups of ``layout`` laid over the ranks of ``process_group`` (None: the world).

    Collective over the pool's ranks only. Grid rank i is the pool's i-th rank in increasing order,
    placed as megatron places ranks (TP fastest, then DP, then PP).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    prepare_megatron()
    ensure_scratch_buffer()
    ranks = tuple(group_ranks(process_group))
    if len(ranks) != layout.world_size:
        raise ValueError(
            f"a pool of {len(ranks)} ranks cannot hold {layout} ({layout.world_size} ranks = "
            f"tensor_parallel {layout.tp} x pipeline_parallel {layout.pp} x data_parallel {layout.dp})"
        )
    me = ranks.index(dist.get_rank())
    coord = layout.coordinate(me)
    tp = _mine(layout.tp_groups(), me, ranks)
    pp = _mine(layout.pp_groups(), me, ranks)
    dp = _mine(layout.dp_groups(), me, ranks)
    mp = _mine(layout.model_parallel_groups(), me, ranks)
    embd = _mine(_embedding_groups(layout), me, ranks)
    stage = _mine(layout.stage_groups(), me, ranks)
    single = subgroup([dist.get_rank()])
    pool = subgroup(ranks)
    # The expert grid folds over each stage's TP x DP ranks (ParallelLayout's docstring); a dense grid's is
    # ETP = TP, EP = 1: expt_tp = tp, expt_dp = dp, tp_ep = tp, tp_ep_pp = mp.
    expert = layout.expert_coordinate(me)
    ep = _mine(layout.expert_parallel_groups(), me, ranks)
    etp = _mine(layout.expert_tp_groups(), me, ranks)
    edp = _mine(layout.expert_dp_groups(), me, ranks)
    tp_ep = _mine(layout.expert_tp_ep_groups(), me, ranks)
    tp_ep_pp = _mine(layout.expert_model_parallel_groups(), me, ranks)
    # Context parallelism as megatron groups it: cp, dp without it (the replicas that take rows of their own),
    # dp_cp with it (every replica of the weights: layout.dp counts them; gradients reduce over it), tp_cp;
    # tp_dp_cp = a stage's ranks. Without CP: cp = this rank alone, dp = dp_cp, tp_cp = tp. The distributed
    # optimizer's single instance spans the pool.
    cp = _mine(layout.cp_groups(), me, ranks)
    data = _mine(layout.data_groups(), me, ranks)
    tp_cp = _mine(layout.tp_cp_groups(), me, ranks)
    collection = ProcessGroupCollection(
        tp=tp, pp=pp, dp=data, mp=mp, embd=embd, pos_embd=single, cp=cp, dp_cp=dp, tp_cp=tp_cp, tp_dp_cp=stage,
        ep=ep, expt_tp=etp, expt_dp=edp, tp_ep=tp_ep, tp_ep_pp=tp_ep_pp, intra_dp_cp=dp, intra_expt_dp=edp,
        intra_dist_opt=pool,
    )
    # The model-parallel RNG (dropout in TP regions) is per process: the grid built last seeds it.
    model_parallel_cuda_manual_seed(seed, tp_rank=coord.tp_rank, ep_rank=expert.ep_rank, etp_rank=expert.etp_rank)
    return MegatronGroups(
        layout=layout, ranks=ranks, tp_rank=coord.tp_rank, pp_rank=coord.pp_rank, dp_rank=coord.dp_rank,
        ep_rank=expert.ep_rank, etp_rank=expert.etp_rank, tp_group=tp, pp_group=pp, dp_group=dp, pool_group=pool,
        collection=collection, ep_group=ep, etp_group=etp, edp_group=edp, cp_rank=layout.cp_rank(me), cp_group=cp,
        data_group=data,
    )
