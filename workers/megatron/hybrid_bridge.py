"""The actor's side of the 3D-HybridEngine: reshard its training shards for generation, and back; or send
them to a rollout on a pool of its own. A colocated rollout sees it as its ``WeightSource``
(``workers.rollout.weight_sync``): the model, the training layout and dtype, and the two transitions.

Each parameter group of the weight plan moves its own way and lands in one ``WeightUpdate``:

- the dense shard, by the micro-DP gather (``Resharder``) or a baseline; a LoRA engine's frozen base once
  per generation layout, kept (at the training layout itself, the training shards: no copy);
- a vision-language model's tower, whole: every rank of the training and generation first stages holds it
  (sent once per generation layout while it is frozen);
- a mixture of experts' routed experts and a LoRA engine's adapters, as their groups' pieces
  (``PieceMover``); the adapters arrive whole and are merged into the kept base's adapted linears
  (``lora_merge``), or handed whole to an engine that serves them."""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridengine.cross_pool.plan import plan_for_model
from hybridengine.cross_pool.transfer import CrossPoolTransfer, message_bytes
from hybridengine.reshard.adapter_group import plan_adapters
from hybridengine.reshard.baselines import BASELINES, RESHARD_METHODS
from hybridengine.reshard.dense_group import move_dense
from hybridengine.reshard.piece_mover import PieceMover
from hybridengine.reshard.plan import GenerationLayout
from hybridengine.reshard.resharder import Resharder
from hybridengine.reshard.transport import TorchTransport
from hybridengine.reshard.weight_plan import WeightPlan, plan_weights
from workers.megatron.engine import MegatronEngine
from workers.megatron.lora_merge import merge_into
from workers.megatron.vision_tower import VISION_MODULE
from workers.rollout.weight_update import WeightUpdate, with_adapters

__all__ = ["HybridBridge", "RESHARD_METHODS"]


class HybridBridge:
    def __init__(self, engine: MegatronEngine, bucket_bytes: int | None = None) -> None:
        """``bucket_bytes``: the resharder's staging budget; ``None`` sizes it from the link's profile
        (``hybridengine.device.collective_profile``)."""
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.transport = TorchTransport()
        self.plans: dict[GenerationLayout, WeightPlan] = {}  # planned once per layout (its groups' plans kept in it)
        self.resharders: dict[GenerationLayout, Resharder] = {}
        self.movers: dict[tuple[str, GenerationLayout | None], PieceMover] = {}  # (group, layout) -> this rank's side
        self._placed: tuple[int, ...] | None = None  # the expert placement the routers are in, while not training's
        self.update: WeightUpdate | None = None  # this rank's generation weights, while they exist
        self.cross_pool: CrossPoolTransfer | None = None
        # a LoRA engine: the frozen base's generation shard per layout (kept), and the merged linears' buffer
        self.base: dict[GenerationLayout, dict[str, torch.Tensor]] = {}
        self.merged: dict[GenerationLayout, dict[str, torch.Tensor]] = {}
        self._last_gen: GenerationLayout | None = None
        self._base_sent = False  # a LoRA engine's frozen base has crossed to the rollout pool
        self._tower_sent: set[GenerationLayout] = set()  # layouts a vision tower has been sent to

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

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.update.weights if self.update is not None else {}

    def _training_params(self) -> dict[str, torch.Tensor]:
        return {name: p.data for name, p in self.engine.module().named_parameters()}

    def _mover(self, kind: str, gen: GenerationLayout | None, plan, params) -> PieceMover:
        """This rank's side of a group's colocated piece plan (``plan``: the plan, or a function that makes it),
        built (and checked against ``params``) once."""
        if (kind, gen) not in self.movers:
            mover = PieceMover.colocated(plan() if callable(plan) else plan, torch.distributed.get_rank(),
                                         self.transport)
            mover.check(params)
            self.movers[kind, gen] = mover
        return self.movers[kind, gen]

    def to_generation(self, gen: GenerationLayout, method: str = "micro_dp", release_training: bool = False,
                      merge_adapters: bool = True) -> dict[str, Any]:
        """Build this rank's generation weights (``update``); collective over all ranks. Returns timing and bytes.

        A mixture of experts' routed experts go point to point (their group's pieces), whatever ``method``
        moves the rest; under generation expert parallelism the router's rows follow the plan's placement.
        A LoRA engine's adapters are merged into them; ``merge_adapters`` False: the weights are the frozen
        base and the adapters come whole (``update.adapters``), for an engine that serves them."""
        if method not in RESHARD_METHODS:
            raise ValueError(f"unknown reshard method {method!r}; valid: {RESHARD_METHODS}")
        if gen not in self.plans:
            self.plans[gen] = plan_weights(self.engine.spec, self.engine.layout, gen)
        plan = self.plans[gen]
        self.to_training()  # at most one generation state at a time; restores released shards
        rank = torch.distributed.get_rank()
        params = self._training_params()
        start, before = time.perf_counter(), self.transport.bytes_received
        lora = self.engine.lora
        # the dense shard: a LoRA engine's frozen base once (kept), else the micro-DP gather
        if lora is not None:
            weights = dict(self._frozen_base(plan, params))
        else:
            weights = self._dense(plan, params, method, release_training)
        dense_bytes, metrics, adapters = self.transport.bytes_received - before, {}, None
        for kind, pieces in plan.piece_plans((lora.rank, lora.targets) if lora is not None else None).items():
            moved = self.transport.bytes_received
            arrived = self._mover(kind, gen if kind != "adapters" else None, pieces, params).move(params)
            metrics[f"reshard/{pieces.group.label}_bytes_received"] = self.transport.bytes_received - moved
            if kind == "adapters":  # whole, to merge or to serve
                adapters = pieces.group.whole(arrived)
            else:
                weights.update(arrived)
        if plan.experts is not None:  # under generation expert parallelism the routers follow the placement
            self._place_router(weights, plan.experts.placement)
        tower = self._vision_tower()
        weights.update(tower)
        if adapters is None:
            # a frozen tower reaches an engine that keeps its weights once per generation layout
            unchanged = set(tower) if tower and gen in self._tower_sent and not self._tower_trains() else set()
            self.update = WeightUpdate(weights, set(weights) - unchanged if unchanged else None)
            self._tower_sent.add(gen)
        else:  # the base kept: after the first sync at this layout only the adapters moved
            me, merged = plan.layout.ranks[rank], self.merged.setdefault(gen, {})

            def merge(base, whole):
                merge_into(base, whole, self.engine.spec, gen, me.gen_tp_rank, me.gen_pp_rank, lora.scaling, merged)
                return merged

            fresh = gen != self._last_gen or bool(dense_bytes)
            self.update = with_adapters(weights, adapters, fresh, not merge_adapters, merge)
        self._last_gen = gen
        me = plan.layout.ranks[rank]
        return {"timing_s/reshard": time.perf_counter() - start,
                "reshard/bytes_received": self.transport.bytes_received - before, **metrics,
                "gen_tp_rank": me.gen_tp_rank, "gen_pp_rank": me.gen_pp_rank, "gen_dp_rank": me.gen_dp_rank}

    def _vision_tower(self) -> dict[str, torch.Tensor]:
        """A vision-language model's tower and merger (megatron names), whole: every rank of the first stage holds
        it and every generation rank takes it whole. A trained tower's are copies (its weights live in the DDP
        buffer, which releasing the training shards frees); a frozen one's, views."""
        tower = getattr(self.engine.module(), VISION_MODULE, None)
        if tower is None:
            return {}
        return {f"{VISION_MODULE}.{name}": p.detach().clone() if p.requires_grad else p.detach()
                for name, p in tower.named_parameters()}

    def _tower_trains(self) -> bool:
        tower = getattr(self.engine.module(), VISION_MODULE, None)
        return tower is not None and any(p.requires_grad for p in tower.parameters())

    def _dense(self, plan: WeightPlan, params, method: str, release_training: bool) -> dict[str, torch.Tensor]:
        """The dense group (all but the routed experts): the micro-DP gather, its pieces (``pieces``), or a baseline
        the gather is measured against."""
        rank, gen = torch.distributed.get_rank(), plan.gen
        dense = {p.name: params[p.name] for p in plan.training_params(rank)}
        if method == "pieces":  # the dense group by the one executor, point to point
            return move_dense(plan, rank, dense, self.transport)
        if method != "micro_dp":
            return BASELINES[method](plan, rank, dense, self.transport)
        if gen not in self.resharders:
            self.resharders[gen] = Resharder(plan, rank, dense, self.transport, self.bucket_bytes)
        return dict(self.resharders[gen].to_generation(release_training=release_training))

    def _frozen_base(self, plan: WeightPlan, params) -> dict[str, torch.Tensor]:
        """A LoRA engine's frozen base at ``plan``'s generation layout: gathered once (the training shards kept),
        the training shards themselves at the training layout."""
        gen, layout = plan.gen, self.engine.layout
        if gen not in self.base:
            rank = torch.distributed.get_rank()
            dense = {p.name: params[p.name] for p in plan.training_params(rank)}
            if (gen.tensor_parallel, gen.pipeline_parallel) == (layout.tp, layout.pp):
                self.base[gen] = dense  # the training shards are the generation shards: no copy
            else:
                self.base[gen] = Resharder(plan, rank, dense, self.transport, self.bucket_bytes).to_generation()
        return self.base[gen]

    def _adapters(self, params) -> dict:
        """Every layer's adapters whole on this rank (their group's pieces: the other TP ranks' cuts of this
        stage's, the other stages' whole), by (layer, linear, part) -> (A, B)."""
        lora = self.engine.lora
        mover = self._mover("adapters", None, lambda: plan_adapters(self.engine.spec, self.engine.layout, lora.rank,
                                                                     lora.targets), params)
        return mover.group.whole(mover.move(params))

    def _place_router(self, weights: dict[str, torch.Tensor], placement: tuple[int, ...]) -> None:
        """Reorder every router's rows in the generation weights to ``placement`` (generation expert k is
        training expert placement[k]); ``_unplace_router`` puts them back."""
        if placement != tuple(range(len(placement))):
            self._permute_routers(weights, torch.tensor(placement))
            self._placed = placement

    def _unplace_router(self) -> None:
        """The routers' rows back in the training order, if ``_place_router`` moved them."""
        if self._placed is not None:
            self._permute_routers(self.weights, torch.argsort(torch.tensor(self._placed)))  # the inverse permutation
            self._placed = None

    @staticmethod
    def _permute_routers(weights: dict[str, torch.Tensor], order: torch.Tensor) -> None:
        """In place: a router may be a view of a training shard (slice plans) or of the buffer a released
        shard returns from."""
        for name, tensor in weights.items():
            if name.endswith("mlp.router.weight"):
                tensor.copy_(tensor[order.to(tensor.device)])

    def to_training(self, offload: bool = False) -> dict[str, float]:
        start = time.perf_counter()
        self._unplace_router()  # the training order, before a released shard is copied back out
        for resharder in self.resharders.values():
            resharder.to_training(offload=offload)
        self.update = None
        return {"timing_s/reshard_back": time.perf_counter() - start}

    # ------------------------------------------------------- a separate rollout pool
    def connect_generation_pool(self, host: str, port: int, gen: GenerationLayout, gen_dp: int, method: str = "auto",
                                timeout_s: float = 600.0, bucket_bytes: int = 256 << 20) -> dict[str, Any]:
        """Join the weight link to a rollout on its own pool (``gen_dp`` replicas at ``gen``); collective over
        both pools. Returns the plan's method and why it was chosen. ``bucket_bytes``: the rollout's
        ``weight_bucket_bytes``, which both sides cut the messages by (it loads them a bucket at a time)."""
        engine = self.engine
        element = next(engine.module().parameters()).element_size()
        plan = plan_for_model(engine.spec, engine.layout, gen, gen_dp, element, method)
        lora = (engine.lora.rank, engine.lora.targets) if engine.lora is not None else None
        self.cross_pool = CrossPoolTransfer.standalone(engine.spec, plan, engine.groups.grid_rank, host, port,
                                                       timeout_s, message_bytes(bucket_bytes), lora=lora)
        self._base_sent = False
        return {"method": plan.method, "reason": plan.reason}

    def send_to_generation_pool(self) -> dict[str, float]:
        """Send this rank's parts of the current weights to the rollout pool (which receives them at once)."""
        if self.cross_pool is None:
            raise RuntimeError("no rollout pool is connected: call connect_generation_pool first")
        before, start = self.cross_pool.bytes_sent, time.perf_counter()
        rank = self.engine.groups.grid_rank
        params = self._training_params()
        if self.engine.lora is not None:  # the frozen base once, then the adapters whole (the rollout merges them)
            if not self._base_sent:
                self.cross_pool.send(rank, params)
                self._base_sent = True
            self.cross_pool.send_adapters(rank, self._adapters(params))
        else:
            self.cross_pool.send(rank, params)
        return {"timing_s/weight_send": time.perf_counter() - start,
                "weight_transfer/bytes_sent": self.cross_pool.bytes_sent - before}
