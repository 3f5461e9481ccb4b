"""The actor's side of the 3D-HybridEngine: reshard its training shards for generation, and back."""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridengine.reshard_baselines import BASELINES, RESHARD_METHODS
from hybridengine.reshard_plan import GenerationLayout, plan_reshard
from hybridengine.resharder import Resharder
from hybridengine.transport import TorchTransport
from workers.megatron.engine import MegatronEngine

__all__ = ["HybridBridge", "RESHARD_METHODS"]


class HybridBridge:
    def __init__(self, engine: MegatronEngine, bucket_bytes: int = 64 << 20) -> None:
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.transport = TorchTransport()
        self.resharders: dict[GenerationLayout, Resharder] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def _training_params(self) -> dict[str, torch.Tensor]:
        return {name: p.data for name, p in self.engine.module().named_parameters()}

    def to_generation(self, gen: GenerationLayout, method: str = "micro_dp", release_training: bool = False) -> dict[str, Any]:
        """Build this rank's generation weights; collective over all ranks. Returns timing and bytes."""
        if method not in RESHARD_METHODS:
            raise ValueError(f"unknown reshard method {method!r}; valid: {RESHARD_METHODS}")
        self.engine.spec.check_layout(gen.tensor_parallel, gen.pipeline_parallel)
        self.to_training()  # at most one generation state at a time; restores released shards
        plan = plan_reshard(self.engine.layout, gen)
        rank = torch.distributed.get_rank()
        before = self.transport.bytes_received
        if method == "micro_dp":
            if gen not in self.resharders:
                self.resharders[gen] = Resharder(
                    self.engine.spec, plan, rank, self._training_params(), self.transport, self.bucket_bytes
                )
            start = time.perf_counter()
            self.weights = self.resharders[gen].to_generation(release_training=release_training)
        else:
            start = time.perf_counter()
            self.weights = BASELINES[method](self.engine.spec, plan, rank, self._training_params(), self.transport)
        me = plan.ranks[rank]
        return {
            "timing_s/reshard": time.perf_counter() - start,
            "reshard/bytes_received": self.transport.bytes_received - before,
            "gen_tp_rank": me.gen_tp_rank,
            "gen_pp_rank": me.gen_pp_rank,
            "gen_dp_rank": me.gen_dp_rank,
        }

    def to_training(self, offload: bool = False) -> dict[str, float]:
        start = time.perf_counter()
        for resharder in self.resharders.values():
            resharder.to_training(offload=offload)
        self.weights = {}
        return {"timing_s/reshard_back": time.perf_counter() - start}
