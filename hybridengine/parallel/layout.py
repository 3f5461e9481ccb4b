"""ParallelLayout: a (TP, PP, DP) grid over a set of ranks, as a plain value.

Ranks are ordered as megatron-core orders them by default: tensor-parallel
fastest, then data-parallel, then pipeline-parallel, so

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Mixture-of-experts layers fold their own grid over the same ranks, as
megatron does: within a pipeline stage the TP x DP ranks are regrouped into
expert-tensor-parallel (ETP, fastest), expert-parallel (EP) and expert-data-
parallel ranks, so

    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))

EP rank e holds experts [e E/ep, (e+1) E/ep), each split ETP ways. A dense
model keeps EP 1 and ETP equal to TP, which is the dense grid itself.

Context parallelism (CP) splits the data-parallel ranks further, as
megatron orders them (TP fastest, then CP, then DP): consecutive groups of
``context_parallel`` data-parallel ranks take the same rows and split each
sequence between them. To the weights CP ranks are data-parallel ranks like
any other, so ``dp`` counts every replica of the weights (megatron's dp x cp)
and ``data_replicas`` the replicas that take rows of their own:

    dp_rank = cp_rank + cp * data_rank

A layout holds no process group; whoever owns the processes builds groups
from the rank lists it returns. Training and generation each have their own
layout in the same processes, so nothing here is global.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import product
from typing import NamedTuple

__all__ = ["ExpertCoordinate", "ParallelLayout", "MeshCoordinate", "divisors"]


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending: the sizes a dimension of ``n`` splits into evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


class MeshCoordinate(NamedTuple):
    tp_rank: int
    pp_rank: int
    dp_rank: int


class ExpertCoordinate(NamedTuple):
    etp_rank: int
    ep_rank: int
    edp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: int = 1  # EP: the experts of a layer split into this many groups of whole experts
    expert_tensor_parallel: int | None = None  # ETP: each expert split this many ways; None: as TP
    # CP: this many consecutive data-parallel ranks share their rows and split each sequence (see the docstring)
    context_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "expert_parallel", "context_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} size must be a positive integer, got {value!r}")
        etp = self.expert_tensor_parallel
        if etp is not None and (not isinstance(etp, int) or isinstance(etp, bool) or etp < 1):
            raise ValueError(f"expert_tensor_parallel size must be a positive integer or None (as TP), got {etp!r}")
        if self.dp % self.cp:
            raise ValueError(f"context_parallel {self.cp} does not divide the {self.dp} data-parallel ranks; "
                             f"sizes that fit: {divisors(self.dp)}")
        stage = self.tp * self.dp
        if stage % (self.etp * self.ep):
            fits = [e for e in divisors(stage) if (stage // e) % self.etp == 0]
            raise ValueError(
                f"expert_parallel {self.ep} x expert_tensor_parallel {self.etp} = {self.ep * self.etp} does not "
                f"divide the {stage} ranks of a pipeline stage (tensor_parallel {self.tp} x data_parallel "
                f"{self.dp}); EP sizes that fit with ETP {self.etp}: {fits}")

    @classmethod
    def for_world(cls, world_size: int, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                  expert_parallel: int = 1, expert_tensor_parallel: int | None = None,
                  context_parallel: int = 1) -> "ParallelLayout":
        """The layout that fills ``world_size`` ranks, data-parallel over what TP*PP leaves (CP among them)."""
        model_parallel = tensor_parallel * pipeline_parallel * context_parallel
        if world_size % model_parallel != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_parallel * pipeline_parallel"
                + (" * context_parallel" if context_parallel > 1 else "")
                + f" = {tensor_parallel} * {pipeline_parallel}" + (f" * {context_parallel}" if context_parallel > 1 else "")
                + f" = {model_parallel}"
            )
        return cls(tensor_parallel, pipeline_parallel, world_size // (tensor_parallel * pipeline_parallel),
                   expert_parallel, expert_tensor_parallel, context_parallel)

    @property
    def tp(self) -> int:
        return self.tensor_parallel

    @property
    def pp(self) -> int:
        return self.pipeline_parallel

    @property
    def dp(self) -> int:
        return self.data_parallel

    @property
    def ep(self) -> int:
        return self.expert_parallel

    @property
    def cp(self) -> int:
        return self.context_parallel

    @property
    def data_replicas(self) -> int:
        """The replicas that take rows of their own: DP / CP (a CP group shares its rows)."""
        return self.dp // self.cp

    @property
    def weights(self) -> "ParallelLayout":
        """This layout as the weights see it: CP ranks are data-parallel ranks (the same ranks, no CP)."""
        return dataclasses.replace(self, context_parallel=1)

    def cp_rank(self, rank: int) -> int:
        """``rank``'s place in its CP group: which chunks of each sequence it holds."""
        return self.coordinate(rank).dp_rank % self.cp

    def data_rank(self, rank: int) -> int:
        """Which replica's rows ``rank`` takes (0 .. data_replicas - 1)."""
        return self.coordinate(rank).dp_rank // self.cp

    @property
    def etp(self) -> int:
        return self.tp if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of each expert shard."""
        return self.tp * self.dp // (self.etp * self.ep)

    @property
    def has_expert_grid(self) -> bool:
        """The expert grid differs from the dense one (EP > 1 or ETP != TP)."""
        return self.ep > 1 or self.etp != self.tp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coordinate(self, rank: int) -> MeshCoordinate:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a layout of {self.world_size} ranks ({self})")
        return MeshCoordinate(
            tp_rank=rank % self.tp,
            pp_rank=rank // (self.tp * self.dp),
            dp_rank=(rank // self.tp) % self.dp,
        )

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        if not (0 <= tp_rank < self.tp and 0 <= pp_rank < self.pp and 0 <= dp_rank < self.dp):
            raise ValueError(f"coordinate (tp={tp_rank}, pp={pp_rank}, dp={dp_rank}) outside {self}")
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def expert_coordinate(self, rank: int) -> ExpertCoordinate:
        """Where ``rank`` sits in the expert grid (see the module docstring)."""
        pp_rank = self.coordinate(rank).pp_rank
        local = rank % (self.tp * self.dp)
        return ExpertCoordinate(local % self.etp, (local // self.etp) % self.ep,
                                local // (self.etp * self.ep), pp_rank)

    def expert_rank_of(self, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int) -> int:
        return etp_rank + self.etp * (ep_rank + self.ep * (edp_rank + self.edp * pp_rank))

    def _expert_groups(self, varying: str) -> list[list[int]]:
        """The rank lists along the expert-grid dimensions named in ``varying`` ("t", "e", "d"), the others fixed."""
        sizes = {"t": self.etp, "e": self.ep, "d": self.edp}
        fixed = [k for k in "ted" if k not in varying]
        groups = []
        for pp_rank in range(self.pp):
            for key in product(*(range(sizes[k]) for k in fixed)):
                group = []
                for moving in product(*(range(sizes[k]) for k in varying)):
                    at = {**dict(zip(fixed, key)), **dict(zip(varying, moving))}
                    group.append(self.expert_rank_of(at["t"], at["e"], at["d"], pp_rank))
                groups.append(sorted(group))
        return groups

    def expert_tp_groups(self) -> list[list[int]]:
        """The ranks that split one expert (ETP)."""
        return self._expert_groups("t")

    def expert_parallel_groups(self) -> list[list[int]]:
        """The ranks that together hold every expert of a layer once per ETP shard (EP)."""
        return self._expert_groups("e")

    def expert_tp_ep_groups(self) -> list[list[int]]:
        """ETP x EP: the ranks that together hold a layer's experts once (megatron's tp_ep)."""
        return self._expert_groups("te")

    def expert_dp_groups(self) -> list[list[int]]:
        """The replicas of one expert shard: their gradients are averaged (megatron's expt_dp)."""
        return self._expert_groups("d")

    def expert_model_parallel_groups(self) -> list[list[int]]:
        """ETP x EP x PP: the ranks that hold one replica of every expert (megatron's tp_ep_pp)."""
        return [sorted(self.expert_rank_of(t, e, d, p) for p in range(self.pp) for e in range(self.ep)
                       for t in range(self.etp)) for d in range(self.edp)]

    def stage_groups(self) -> list[list[int]]:
        """Every rank of one pipeline stage (TP x DP; megatron's tp_dp_cp without context parallelism)."""
        return [[r for r in range(self.world_size) if self.coordinate(r).pp_rank == p] for p in range(self.pp)]

    def is_collect_rank(self, rank: int) -> bool:
        """TP rank 0 (and CP rank 0) of the last pipeline stage: the rank whose outputs stand for its replica."""
        coord = self.coordinate(rank)
        return coord.tp_rank == 0 and coord.pp_rank == self.pp - 1 and coord.dp_rank % self.cp == 0

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, p, d) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, p, d) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """Every replica of one weight shard (CP ranks included): megatron's dp_cp, over which gradients reduce."""
        return [[self.rank_of(t, p, d) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def cp_groups(self) -> list[list[int]]:
        """The ranks that split each sequence of the same rows (consecutive DP ranks)."""
        return [[self.rank_of(t, p, c + self.cp * d) for c in range(self.cp)]
                for p in range(self.pp) for d in range(self.data_replicas) for t in range(self.tp)]

    def tp_cp_groups(self) -> list[list[int]]:
        """TP x CP: the ranks that together hold one copy of a sequence's activations (megatron's tp_cp)."""
        return [sorted(self.rank_of(t, p, c + self.cp * d) for c in range(self.cp) for t in range(self.tp))
                for p in range(self.pp) for d in range(self.data_replicas)]

    def data_groups(self) -> list[list[int]]:
        """The ranks with the same CP rank in every replica that takes rows of its own (megatron's dp without cp):
        sums over a batch's rows reduce over them."""
        return [[self.rank_of(t, p, c + self.cp * d) for d in range(self.data_replicas)]
                for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def model_parallel_groups(self) -> list[list[int]]:
        """The TP*PP ranks that together hold one model replica, one list per DP rank."""
        return [
            sorted(self.rank_of(t, p, d) for p in range(self.pp) for t in range(self.tp)) for d in range(self.dp)
        ]

    def __str__(self) -> str:
        experts = f"xEP{self.ep}" if self.ep > 1 else ""
        if self.etp != self.tp:
            experts += f"xETP{self.etp}"
        if self.cp > 1:
            return f"TP{self.tp}xCP{self.cp}xPP{self.pp}xDP{self.data_replicas}{experts}"
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp}{experts}"

