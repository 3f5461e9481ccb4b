"""What one weight sync hands the generator, whatever moved it: one value, and one way to apply it.

A sync (colocated or across pools) moves every parameter group of the weight plan (the dense shard, a
mixture of experts' routed experts, a LoRA actor's adapters) and hands the generator a ``WeightUpdate``: the
generation shard (whole, or as a stream of buckets that arrive one at a time), which of its tensors changed
since the last update at this layout, and the adapters whole when the engine serves them unmerged.

``apply_update`` is the one place that decides what the engine takes: only what changed where it keeps
the rest; bucket by bucket where it loads that way (``BucketLoading``: the engine's temporaries, and a
streamed update's buffer, are then one bucket); the adapters through ``update_adapters`` where it serves
them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from hybridengine.reshard.weight_plan import cut_into_buckets
from workers.rollout.generator import loads_in_buckets

__all__ = ["WeightUpdate", "apply_update", "in_buckets", "with_adapters"]

# a layer's routed experts load together: an engine stacks them into one tensor per layer (vLLM's w13, w2)
_EXPERTS = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.")


@dataclass
class WeightUpdate:
    weights: dict[str, torch.Tensor]  # this rank's generation shard, megatron names local to its generation stage
    changed: set[str] | None = None  # the names in ``weights`` that changed since the last update; None: all
    adapters: dict | None = None  # (layer, linear, part) -> (A, B) whole, for an engine that serves them unmerged
    # the shard as buckets instead of ``weights`` (each bucket's tensors valid until the next is asked for)
    stream: Iterable[dict[str, torch.Tensor]] | None = None

    def taken_by(self, generator) -> dict[str, torch.Tensor]:
        """The tensors ``generator`` must load: only those that changed where it keeps the rest."""
        if self.changed is not None and generator.accepts_partial_weights:
            return {name: self.weights[name] for name in self.changed}
        return self.weights


def with_adapters(base: dict[str, torch.Tensor], adapters: dict, fresh: bool, serve: bool, merge) -> WeightUpdate:
    """A LoRA actor's update: its kept base with the adapters whole, handed over for an engine that serves them
    (``serve``), else merged, ``merge(base, adapters)`` giving the merged linears. ``fresh``: the base itself is
    new to the engine (a first sync, another layout), so all of it changed; else only the adapted linears."""
    if serve:
        return WeightUpdate(base, None if fresh else set(), adapters)
    merged = merge(base, adapters)
    return WeightUpdate({**base, **merged}, None if fresh else set(merged))


def in_buckets(weights: dict[str, torch.Tensor], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """``weights`` in order, in buckets of at most ``bucket_bytes``; what an engine loads as one layer stays in
    one bucket (a module's tensors, a layer's routed experts), alone where it is larger."""
    def owner(item) -> str:
        experts = _EXPERTS.match(item[0])
        return experts.group(1) if experts else item[0].rpartition(".")[0]

    for bucket in cut_into_buckets(list(weights.items()), lambda item: item[1].numel() * item[1].element_size(),
                                   owner, bucket_bytes):
        yield dict(bucket)


def apply_update(generator, update: WeightUpdate, bucket_bytes: int | None = None) -> dict[str, Any]:
    """``update`` into ``generator``; the engine's metrics (``timing_s/weight_sync``, ``weight_sync/bytes``).
    ``bucket_bytes``: an engine that loads in buckets takes a whole update this many bytes at a time."""
    metrics: dict[str, Any] = {}
    if update.stream is not None:
        if not loads_in_buckets(generator):
            raise ValueError(f"{type(generator).__name__} does not load its weights in buckets; a streamed update "
                             f"needs an engine that does (BucketLoading)")
        metrics.update(generator.update_weights_in_buckets(update.stream))
    else:
        weights = update.taken_by(generator)
        if weights or update.adapters is None:
            if bucket_bytes and loads_in_buckets(generator):
                metrics.update(generator.update_weights_in_buckets(in_buckets(weights, bucket_bytes)))
            else:
                metrics.update(generator.update_weights(weights))
    if update.adapters is not None:
        from workers.megatron.lora_peft import peft_tensors

        metrics.update(generator.update_adapters(peft_tensors(update.adapters)))
    return metrics
