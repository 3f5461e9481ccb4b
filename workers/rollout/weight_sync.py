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

Both moving syncs report the same two figures beside their own:
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
from workers.rollout.generator import Generator, serves_adapters
from workers.rollout.training_layout import TrainingLayout

__all__ = ["CheckpointWeights", "ColocatedSync", "CrossPoolSync", "WeightSource", "WeightSync", "weight_sync_for"]

_PLAN_KEYS = ("gen_tp_rank", "gen_pp_rank", "gen_dp_rank")  # coordinates the source reports, not metrics


class WeightSource(Protocol):
    """The actor's side of a colocated sync (``workers.megatron.hybrid_bridge.HybridBridge``)."""

    spec: ModelSpec  # the model as its shards are cut (vocabulary padded)
    layout: ParallelLayout  # the training layout
    dtype: torch.dtype
    weights: dict[str, torch.Tensor]  # this rank's generation shard, while it exists
    # the names in ``weights`` whose contents changed since the last ``to_generation`` at this layout; None: all
    changed: set[str] | None

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
                 release_training: bool = True) -> None:
        self.source, self.gen, self.method, self.release_training = source, gen, method, release_training

    def update(self, generator: Generator) -> dict[str, Any]:
        start = time.perf_counter()  # the engine wakes what it needs itself: weights now, the KV cache to generate
        serves = serves_adapters(generator)  # a LoRA actor's adapters, unmerged
        moved = self.source.to_generation(self.gen, self.method, self.release_training,
                                          **({"merge_adapters": False} if serves else {}))
        metrics = {k: v for k, v in moved.items() if k not in _PLAN_KEYS}
        weights, changed = self.source.weights, getattr(self.source, "changed", None)
        if changed is not None and generator.accepts_partial_weights:
            weights = {name: weights[name] for name in changed}  # e.g. a LoRA actor's merged linears
        if weights or not serves:
            metrics.update(generator.update_weights(weights))
        if serves:
            metrics.update(generator.update_adapters(self.source.lora_adapters()))
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
                 device: torch.device | str, training: TrainingLayout, lora: LoRAConfig | None = None) -> None:
        """``lora`` (the actor's LoRA section: rank, alpha, targets): the actor trains LoRA adapters; its frozen base arrives once and is
        kept, then every update brings the adapters whole, merged here (or served, by an engine that can)."""
        self.spec, self.gen, self.gen_dp, self.rank, self.dtype, self.device = spec, gen, gen_dp, rank, dtype, device
        self.lora, self.base, self.merged, self._layout = lora, None, {}, None
        self.train = training.layout
        self.transfer = None

    def connect(self, host: str, port: int, method: str = "auto", timeout_s: float = 600.0) -> dict[str, Any]:
        from hybridengine.cross_pool.plan import plan_for_model
        from hybridengine.cross_pool.transfer import CrossPoolTransfer

        element = torch.empty((), dtype=self.dtype).element_size()
        plan = plan_for_model(self.spec, self.train, self.gen, self.gen_dp, element, method)
        self.transfer = CrossPoolTransfer.standalone(self.spec, plan, self.train.world_size + self.rank, host, port,
                                                     timeout_s)
        return {"method": plan.method, "reason": plan.reason}

    def update(self, generator: Generator) -> dict[str, Any]:
        if self.transfer is None:
            raise RuntimeError("no training pool is connected: call connect_training_pool first")
        before, start = self.transfer.bytes_received, time.perf_counter()
        if self.lora is not None:
            return self._update_lora(generator, before, start)
        weights = self.transfer.receive(self.rank, self.dtype, self.device)
        received = self.transfer.bytes_received - before
        metrics = {"timing_s/weight_transfer": time.perf_counter() - start, "weight_transfer/bytes": received,
                   "weight_transfer/bound_bytes": sum(w.numel() * w.element_size() for w in weights.values())}
        metrics.update(generator.update_weights(weights))
        metrics["timing_s/weight_update"] = time.perf_counter() - start
        metrics["weight_update/bytes_received"] = received
        if not generator.borrows_weights:
            self.transfer.release()  # the engine holds its own copy; a borrowing one keeps the views until the next
        return metrics

    def _update_lora(self, generator: Generator, before: int, start: float) -> dict[str, Any]:
        """A LoRA actor's weights: the base at the first update (kept), then its adapters whole, merged into the
        base's adapted linears (the generator takes those alone when it can) or served unmerged."""
        from workers.megatron.lora_generation import adapter_layout, merge_into, unflatten_adapters
        from workers.megatron.lora_peft import peft_tensors

        first = self.base is None
        if first:  # the base stays in the transfer's buffer: it is never released
            self.base = self.transfer.receive(self.rank, self.dtype, self.device)
        if self._layout is None:  # the adapters' flat message, the same at every update
            self._layout = adapter_layout(self.spec, self.lora.rank, self.lora.targets)
        numel = sum(a[0] * a[1] + b[0] * b[1] for _, a, b in self._layout)
        adapters = unflatten_adapters(self.transfer.receive_whole(numel, self.dtype, self.device), self._layout)
        received = self.transfer.bytes_received - before
        metrics = {"timing_s/weight_transfer": time.perf_counter() - start, "weight_transfer/bytes": received}
        if serves_adapters(generator):
            if first:
                metrics.update(generator.update_weights(self.base))
            metrics.update(generator.update_adapters(peft_tensors(adapters)))
        else:
            coord = self.transfer.plan.gen_coordinate(self.rank)
            merge_into(self.base, adapters, self.spec, self.gen, coord.tp_rank, coord.pp_rank,
                       self.lora.alpha / self.lora.rank, self.merged)
            partial = not first and generator.accepts_partial_weights
            metrics.update(generator.update_weights(dict(self.merged) if partial else {**self.base, **self.merged}))
        metrics["timing_s/weight_update"] = time.perf_counter() - start
        metrics["weight_update/bytes_received"] = received
        return metrics

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


def weight_sync_for(source: WeightSource | None, training: TrainingLayout | None, *, spec: ModelSpec,
                    gen: GenerationLayout, gen_dp: int, rank: int, dtype: torch.dtype, device: torch.device | str,
                    method: str = "micro_dp", release_training: bool = True,
                    lora: LoRAConfig | None = None) -> WeightSync:
    """The way weights reach this rollout: from a colocated actor's ``source``, across pools from the
    actor's pool described by ``training``, or none (the engine's own checkpoint)."""
    if source is not None and training is not None:
        raise ValueError("weights come from a colocated actor's source or from a training pool, not both")
    if source is not None:
        return ColocatedSync(source, gen, method, release_training)
    if training is not None:
        return CrossPoolSync(spec, gen, gen_dp, rank, dtype, device, training, lora)
    return CheckpointWeights()
