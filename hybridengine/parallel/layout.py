"""ParallelLayout: a (TP, PP, DP) grid over a set of ranks, as a plain value.

Ranks are ordered as megatron-core orders them by default: tensor-parallel
fastest, then data-parallel, then pipeline-parallel, so

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

A layout holds no process group; whoever owns the processes builds groups
from the rank lists it returns. Training and generation each have their own
layout in the same processes, so nothing here is global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["ParallelLayout", "MeshCoordinate", "divisors"]


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending: the sizes a dimension of ``n`` splits into evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


class MeshCoordinate(NamedTuple):
    tp_rank: int
    pp_rank: int
    dp_rank: int


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} size must be a positive integer, got {value!r}")

    @classmethod
    def for_world(cls, world_size: int, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> "ParallelLayout":
        """The layout that fills ``world_size`` ranks, data-parallel over what TP*PP leaves."""
        model_parallel = tensor_parallel * pipeline_parallel
        if world_size % model_parallel != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_parallel * pipeline_parallel = "
                f"{tensor_parallel} * {pipeline_parallel} = {model_parallel}"
            )
        return cls(tensor_parallel, pipeline_parallel, world_size // model_parallel)

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

    def is_collect_rank(self, rank: int) -> bool:
        """TP rank 0 of the last pipeline stage: the rank whose outputs stand for its DP replica."""
        coord = self.coordinate(rank)
        return coord.tp_rank == 0 and coord.pp_rank == self.pp - 1

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, p, d) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, p, d) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, p, d) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def model_parallel_groups(self) -> list[list[int]]:
        """The TP*PP ranks that together hold one model replica, one list per DP rank."""
        return [
            sorted(self.rank_of(t, p, d) for p in range(self.pp) for t in range(self.tp)) for d in range(self.dp)
        ]

    def __str__(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp}"
