"""TrainingLayout: how the actor's pool cuts the weights a rollout on a pool of its own receives."""

from __future__ import annotations

from dataclasses import dataclass

from hybridengine.parallel.layout import ParallelLayout
from workers.megatron.config import PRECISIONS, EngineConfig

__all__ = ["TrainingLayout"]


@dataclass(frozen=True)
class TrainingLayout:
    """The actor's layout (TP x PP x DP, EP and ETP), its vocabulary padding and its precision: the
    shards that cross to the rollout's pool are cut, padded and typed by them."""

    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    make_vocab_size_divisible_by: int | None = None
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        self.layout  # a bad size is refused here, naming it

    @classmethod
    def of_actor(cls, engine: EngineConfig, world_size: int) -> "TrainingLayout":
        """The layout of an actor on ``world_size`` ranks with ``engine`` (data-parallel over what TP x PP leaves)."""
        return cls(engine.tensor_parallel, engine.pipeline_parallel,
                   world_size // (engine.tensor_parallel * engine.pipeline_parallel), engine.expert_parallel,
                   engine.expert_tensor_parallel, engine.make_vocab_size_divisible_by, engine.precision)

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tensor_parallel, self.pipeline_parallel, self.data_parallel, self.expert_parallel,
                              self.expert_tensor_parallel)
