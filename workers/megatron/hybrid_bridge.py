"""The actor's side of the 3D-HybridEngine: reshard its training shards for generation, and back; or send
them to a rollout on a pool of its own. A colocated rollout sees it as its ``WeightSource``
(``workers.rollout.weight_sync``): the model, the training layout and dtype, and the two transitions."""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridengine.cross_pool.plan import plan_for_model
from hybridengine.cross_pool.transfer import CrossPoolTransfer
from hybridengine.reshard.baselines import BASELINES, RESHARD_METHODS
from hybridengine.reshard.expert_resharder import ExpertResharder
from hybridengine.reshard.plan import GenerationLayout
from hybridengine.reshard.resharder import Resharder
from hybridengine.reshard.transport import TorchTransport
from hybridengine.reshard.weight_plan import plan_weights
from workers.megatron.engine import MegatronEngine
from workers.megatron.lora_generation import LoRAGenerationWeights, adapter_layout, flatten_adapters
from workers.megatron.lora_peft import peft_tensors

__all__ = ["HybridBridge", "RESHARD_METHODS"]


class HybridBridge:
    def __init__(self, engine: MegatronEngine, bucket_bytes: int | None = None) -> None:
        """``bucket_bytes``: the resharder's staging budget; ``None`` sizes it from the link's profile
        (``hybridengine.device.collective_profile``)."""
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.transport = TorchTransport()
        self.resharders: dict[GenerationLayout, Resharder] = {}
        self.expert_resharders: dict[GenerationLayout, ExpertResharder] = {}
        self._placed: tuple[int, ...] | None = None  # the expert placement the routers are in, while not training's
        self.weights: dict[str, torch.Tensor] = {}
        self.changed: set[str] | None = None  # of ``weights``, what changed since the last sync at this layout
        self.cross_pool: CrossPoolTransfer | None = None
        # a LoRA engine's generation weights: the base resharded once, the adapters merged in every sync
        self.lora = LoRAGenerationWeights(engine, self.transport, bucket_bytes) if engine.adapters else None
        self._last_gen: GenerationLayout | None = None
        self._base_sent = False  # a LoRA engine's frozen base has crossed to the rollout pool

    @property
    def spec(self):
        """The model as the training shards are cut (vocabulary padded as the engine pads it)."""
        return self.engine.spec

    @property
    def layout(self):
        return self.engine.layout

    @property
    def dtype(self) -> torch.dtype:
        return next(self.engine.module().parameters()).dtype

    def _training_params(self) -> dict[str, torch.Tensor]:
        return {name: p.data for name, p in self.engine.module().named_parameters()}

    def to_generation(self, gen: GenerationLayout, method: str = "micro_dp", release_training: bool = False,
                      merge_adapters: bool = True) -> dict[str, Any]:
        """Build this rank's generation weights; collective over all ranks. Returns timing and bytes.

        A mixture of experts' routed experts go point to point (``ExpertResharder``), whatever ``method``
        moves the rest; under generation expert parallelism the router's rows follow the plan's placement.
        A LoRA engine's adapters are merged into them; ``merge_adapters`` False: the weights are the frozen
        base and the adapters come whole in PEFT's names (``lora_adapters``), for an engine that serves them."""
        if method not in RESHARD_METHODS:
            raise ValueError(f"unknown reshard method {method!r}; valid: {RESHARD_METHODS}")
        weights = plan_weights(self.engine.spec, self.engine.layout, gen)
        self.to_training()  # at most one generation state at a time; restores released shards
        rank = torch.distributed.get_rank()
        before = self.transport.bytes_received
        if self.lora is not None:  # the frozen base once (by the micro-DP plan), then only the adapters
            start = time.perf_counter()
            self.weights, moved = self.lora.build(weights, self._training_params(), merge_adapters)
            self.changed = None if moved["base"] or gen != self._last_gen else (
                set(self.lora.merged[gen]) if merge_adapters else set())
            self._last_gen = gen
            me = weights.layout.ranks[rank]
            return {"timing_s/reshard": time.perf_counter() - start,
                    "reshard/bytes_received": moved["base"] + moved["lora"], "reshard/lora_bytes_received": moved["lora"],
                    "gen_tp_rank": me.gen_tp_rank, "gen_pp_rank": me.gen_pp_rank, "gen_dp_rank": me.gen_dp_rank}
        self.changed, self._last_gen = None, gen
        params = self._training_params()

        def dense() -> dict[str, torch.Tensor]:  # all but the routed experts: what the micro-DP plan moves
            return {p.name: params[p.name] for p in weights.training_params(rank)}

        if method == "micro_dp":
            if gen not in self.resharders:
                self.resharders[gen] = Resharder(weights, rank, dense(), self.transport, self.bucket_bytes)
            start = time.perf_counter()
            self.weights = self.resharders[gen].to_generation(release_training=release_training)
        else:
            start = time.perf_counter()
            self.weights = BASELINES[method](weights, rank, dense(), self.transport)
        dense_bytes = self.transport.bytes_received - before
        moe = self.engine.spec.moe is not None
        if moe:  # the experts' plan is built once per layout, with their resharder (not every step)
            if gen not in self.expert_resharders:
                self.expert_resharders[gen] = ExpertResharder(weights.experts, rank, params, self.transport)
            experts = self.expert_resharders[gen]
            self.weights.update(experts.to_generation())
            self._place_router(experts.plan.placement)
        me = weights.layout.ranks[rank]
        return {
            "timing_s/reshard": time.perf_counter() - start,
            "reshard/bytes_received": self.transport.bytes_received - before,
            **({"reshard/expert_bytes_received": self.transport.bytes_received - before - dense_bytes}
               if moe else {}),
            "gen_tp_rank": me.gen_tp_rank,
            "gen_pp_rank": me.gen_pp_rank,
            "gen_dp_rank": me.gen_dp_rank,
        }

    def lora_adapters(self) -> dict[str, torch.Tensor]:
        """The adapters of the last unmerged sync, whole, on the CPU under PEFT's names."""
        return peft_tensors(self.lora.whole)

    def _place_router(self, placement: tuple[int, ...]) -> None:
        """Reorder every router's rows in the generation weights to ``placement`` (generation expert k is
        training expert placement[k]); ``_unplace_router`` puts them back."""
        if placement != tuple(range(len(placement))):
            self._permute_routers(torch.tensor(placement))
            self._placed = placement

    def _unplace_router(self) -> None:
        """The routers' rows back in the training order, if ``_place_router`` moved them."""
        if self._placed is not None:
            self._permute_routers(torch.argsort(torch.tensor(self._placed)))  # the inverse permutation
            self._placed = None

    def _permute_routers(self, order: torch.Tensor) -> None:
        """In place: a router may be a view of a training shard (slice plans) or of the buffer a released
        shard returns from."""
        for name, tensor in self.weights.items():
            if name.endswith("mlp.router.weight"):
                tensor.copy_(tensor[order.to(tensor.device)])

    def to_training(self, offload: bool = False) -> dict[str, float]:
        start = time.perf_counter()
        self._unplace_router()  # the training order, before a released shard is copied back out
        for resharder in self.resharders.values():
            resharder.to_training(offload=offload)
        self.weights = {}
        return {"timing_s/reshard_back": time.perf_counter() - start}

    # ------------------------------------------------------- a separate rollout pool
    def connect_generation_pool(self, host: str, port: int, gen: GenerationLayout, gen_dp: int, method: str = "auto",
                                timeout_s: float = 600.0) -> dict[str, Any]:
        """Join the weight link to a rollout on its own pool (``gen_dp`` replicas at ``gen``); collective over
        both pools. Returns the plan's method and why it was chosen."""
        engine = self.engine
        element = next(engine.module().parameters()).element_size()
        plan = plan_for_model(engine.spec, engine.layout, gen, gen_dp, element, method)
        self.cross_pool = CrossPoolTransfer.standalone(engine.spec, plan, engine.groups.grid_rank, host, port,
                                                       timeout_s, self.bucket_bytes or 64 << 20)
        self._base_sent = False
        return {"method": plan.method, "reason": plan.reason}

    def send_to_generation_pool(self) -> dict[str, float]:
        """Send this rank's parts of the current weights to the rollout pool (which receives them at once)."""
        if self.cross_pool is None:
            raise RuntimeError("no rollout pool is connected: call connect_generation_pool first")
        before, start = self.cross_pool.bytes_sent, time.perf_counter()
        rank = self.engine.groups.grid_rank
        if self.lora is not None:  # the frozen base once, then the adapters whole (the rollout merges them)
            if not self._base_sent:
                self.cross_pool.send(rank, self._training_params())
                self._base_sent = True
            adapters, _ = self.lora.gather_adapters()
            lora = self.engine.lora
            self.cross_pool.send_whole(rank, flatten_adapters(adapters, adapter_layout(self.engine.spec, lora.rank,
                                                                                       lora.targets)))
        else:
            self.cross_pool.send(rank, self._training_params())
        return {"timing_s/weight_send": time.perf_counter() - start,
                "weight_transfer/bytes_sent": self.cross_pool.bytes_sent - before}
