"""How the policy's current weights reach this rank's generator: one interface, three ways.

``weight_sync_for`` is the one place that decides which way applies:

- ``ColocatedSync``: the rollout shares its processes with the actor. Before
  each generation the actor's ``WeightSource`` (its hybrid bridge) reshards
  the training shards into the generation layout, in place, through the
  3D-HybridEngine, and the generator takes them. An engine that copies
  (vLLM) lets the source drop its buffer at once; one that borrows (megatron)
  keeps views of it until the generation is done.
- ``CrossPoolSync``: the rollout has a pool of its own. The trainer pushes
  the weights when the rollout's copy is stale (``controller.rl.rollout_pool``):
  each generation rank receives exactly its shard from the training ranks
  (``hybridengine.cross_pool``), and the generator takes them.
- ``CheckpointWeights``: no source; the engine serves ``model_path`` as loaded.

Both moving syncs hand the generator one ``WeightUpdate`` (``workers.rollout.weight_update``: the shard,
what changed, a LoRA actor's adapters when the engine serves them) and report the same two figures beside
their own:
``timing_s/weight_update`` (from the start of the move to the engine holding
the weights) and ``weight_update/bytes_received`` (what this rank received
over the network), with the engine's ``timing_s/weight_sync`` and
``weight_sync/bytes``.
"""

from __future__ import annotations

import abc
import time
from typing import Any, Protocol

import torch

from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.plan import GenerationLayout
from workers.megatron.lora import LoRAConfig
from workers.megatron.lora_merge import merge_into
from workers.rollout.generator import Generator, loads_in_buckets, serves_adapters
from workers.rollout.training_layout import TrainingLayout
from workers.rollout.weight_update import WeightUpdate, apply_update, with_adapters

__all__ = ["CheckpointWeights", "ColocatedSync", "CrossPoolSync", "WeightSource", "WeightSync", "weight_sync_for"]

_PLAN_KEYS = ("gen_tp_rank", "gen_pp_rank", "gen_dp_rank")  # coordinates the source reports, not metrics


class WeightSource(Protocol):
    """The actor's side of a colocated sync (``workers.megatron.hybrid_bridge.HybridBridge``)."""

    spec: ModelSpec  # the model as its shards are cut (vocabulary padded)
    layout: ParallelLayout  # the training layout
    dtype: torch.dtype
    update: WeightUpdate | None  # this rank's generation weights, while they exist

    def to_generation(self, gen: GenerationLayout, method: str = "micro_dp",
                      release_training: bool = False) -> dict[str, Any]: ...

    def to_training(self, offload: bool = False) -> dict[str, float]: ...


class WeightSync(abc.ABC):
    """Gets the current weights into a generator. ``pushed``: they arrive when the trainer sends them
    (``update`` is called from outside); otherwise the rollout calls ``update`` before each generation."""

    pushed: bool = False

    @abc.abstractmethod
    def update(self, generator: Generator) -> dict[str, Any]:
        """The current weights into ``generator``; the move's metrics."""

    def done(self, generator: Generator) -> dict[str, Any]:
        """After a generation: let go of what it no longer needs."""
        return {}

    def close(self) -> None:
        pass


class ColocatedSync(WeightSync):
    pushed = False

    def __init__(self, source: WeightSource, gen: GenerationLayout, method: str = "micro_dp",
                 release_training: bool = True, bucket_bytes: int = 256 << 20) -> None:
        self.source, self.gen, self.method, self.release_training = source, gen, method, release_training
        self.bucket_bytes = bucket_bytes

    def update(self, generator: Generator) -> dict[str, Any]:
        start = time.perf_counter()  # the engine wakes what it needs itself: weights now, the KV cache to generate
        serves = serves_adapters(generator)  # a LoRA actor's adapters, unmerged
        moved = self.source.to_generation(self.gen, self.method, self.release_training,
                                          **({"merge_adapters": False} if serves else {}))
        metrics = {k: v for k, v in moved.items() if k not in _PLAN_KEYS}
        metrics.update(apply_update(generator, self.source.update, self.bucket_bytes))
        metrics["timing_s/weight_update"] = time.perf_counter() - start
        metrics["weight_update/bytes_received"] = metrics["reshard/bytes_received"]
        if not generator.borrows_weights:
            metrics.update(self.source.to_training())  # the engine holds its own copy: the buffer can go now
        return metrics

    def done(self, generator: Generator) -> dict[str, Any]:
        generator.release()  # a borrowing engine lets go of the buffer's views, so the buffer can be freed
        return self.source.to_training() if generator.borrows_weights else {}


class CrossPoolSync(WeightSync):
    """The generation side of the cross-pool link; ``connect`` joins it (with the actor's side, at once)."""

    pushed = True

    def __init__(self, spec: ModelSpec, gen: GenerationLayout, gen_dp: int, rank: int, dtype: torch.dtype,
                 device: torch.device | str, training: TrainingLayout, lora: LoRAConfig | None = None,
                 bucket_bytes: int = 256 << 20) -> None:
        """``lora`` (the actor's LoRA section: rank, alpha, targets): the actor trains LoRA adapters; its frozen
        base arrives once and is kept, then every update brings the adapters whole, merged here (or served, by
        an engine that can). ``bucket_bytes``: the messages' size, and the buckets an engine that loads in
        buckets takes the weights in, each before the next arrives (the whole shard is never held)."""
        self.spec, self.gen, self.gen_dp, self.rank, self.dtype, self.device = spec, gen, gen_dp, rank, dtype, device
        self.bucket_bytes = bucket_bytes
        self.lora, self.base, self.merged = lora, None, {}
        self.train = training.layout
        self.transfer = None

    def connect(self, host: str, port: int, method: str = "auto", timeout_s: float = 600.0) -> dict[str, Any]:
        from hybridengine.cross_pool.plan import plan_for_model
        from hybridengine.cross_pool.transfer import CrossPoolTransfer, message_bytes

        element = torch.empty((), dtype=self.dtype).element_size()
        plan = plan_for_model(self.spec, self.train, self.gen, self.gen_dp, element, method)
        lora = (self.lora.rank, self.lora.targets) if self.lora is not None else None
        self.transfer = CrossPoolTransfer.standalone(self.spec, plan, self.train.world_size + self.rank, host, port,
                                                     timeout_s, message_bytes(self.bucket_bytes), lora=lora)
        return {"method": plan.method, "reason": plan.reason}

    def update(self, generator: Generator) -> dict[str, Any]:
        """Every group the actor sends: the dense shard (a LoRA actor's frozen base once, kept) with a mixture of
        experts' routed experts, then a LoRA actor's adapters; into the generator as one ``WeightUpdate``."""
        if self.transfer is None:
            raise RuntimeError("no training pool is connected: call connect_training_pool first")
        before, start = self.transfer.bytes_received, time.perf_counter()
        if self.lora is None and loads_in_buckets(generator):  # each bucket into the engine as it lands
            landed = []
            stream = self.transfer.receive_buckets(self.rank, self.dtype, self.device, keep=False)
            metrics = apply_update(generator, WeightUpdate({}, stream=_counted(stream, landed)))
            transfer_s, shard = time.perf_counter() - start, sum(landed)  # the transfer and the loads interleave
        else:
            fresh = self.base is None
            weights = self.base if not fresh else self.transfer.receive(self.rank, self.dtype, self.device)
            adapters = None
            if self.lora is not None:  # the base stays in the transfer's buffer: it is never released
                self.base = weights
                adapters = self.transfer.receive_adapters(self.rank, self.dtype, self.device)
            transfer_s = time.perf_counter() - start
            update = WeightUpdate(weights) if adapters is None else with_adapters(
                weights, adapters, fresh, serves_adapters(generator), self._merge)
            metrics = apply_update(generator, update, self.bucket_bytes)
            shard = sum(w.numel() * w.element_size() for w in weights.values()) if fresh else None
        received = self.transfer.bytes_received - before
        metrics.update({"timing_s/weight_transfer": transfer_s, "weight_transfer/bytes": received})
        if self.lora is None:
            metrics["weight_transfer/bound_bytes"] = shard
        metrics["timing_s/weight_update"] = time.perf_counter() - start
        metrics["weight_update/bytes_received"] = received
        if self.lora is None and not generator.borrows_weights:
            self.transfer.release()  # the engine holds its own copy; a borrowing one keeps the views until the next
        return metrics

    def _merge(self, base: dict[str, torch.Tensor], adapters: dict) -> dict[str, torch.Tensor]:
        """The adapters merged into this generation rank's cut of the base's adapted linears (kept, refilled)."""
        coord = self.transfer.plan.gen_coordinate(self.rank)
        merge_into(base, adapters, self.spec, self.gen, coord.tp_rank, coord.pp_rank, self.lora.alpha / self.lora.rank,
                   self.merged)
        return self.merged

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None


class CheckpointWeights(WeightSync):
    """No weight source: the engine serves the checkpoint it loaded."""

    pushed = True  # nothing arrives before a generation; ``update`` is refused

    def update(self, generator: Generator) -> dict[str, Any]:
        raise RuntimeError("this rollout serves its own checkpoint: it has no actor to take weights from and no "
                           "training pool to connect to")


def _counted(stream, landed: list):
    """``stream``'s buckets as they are, their bytes appended to ``landed``."""
    for bucket in stream:
        landed.append(sum(t.numel() * t.element_size() for t in bucket.values()))
        yield bucket


def weight_sync_for(source: WeightSource | None, training: TrainingLayout | None, *, spec: ModelSpec,
                    gen: GenerationLayout, gen_dp: int, rank: int, dtype: torch.dtype, device: torch.device | str,
                    method: str = "micro_dp", release_training: bool = True,
                    lora: LoRAConfig | None = None, bucket_bytes: int = 256 << 20) -> WeightSync:
    """The way weights reach this rollout: from a colocated actor's ``source``, across pools from the
    actor's pool described by ``training``, or none (the engine's own checkpoint)."""
    if source is not None and training is not None:
        raise ValueError("weights come from a colocated actor's source or from a training pool, not both")
    if source is not None:
        return ColocatedSync(source, gen, method, release_training, bucket_bytes)
    if training is not None:
        return CrossPoolSync(spec, gen, gen_dp, rank, dtype, device, training, lora, bucket_bytes)
    return CheckpointWeights()
