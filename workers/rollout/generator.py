"""The generator protocol: what the rollout asks of a generation engine, and the registry of engines.

A generator is one rank's generation engine at a generation layout. Weights
are pushed into it (``update_weights``, this rank's generation shard in
megatron's names and the generation layout); it never reaches for them. The
rollout drives every engine through the same five calls and never branches
on an engine's name:

- ``update_weights(weights)``: take the current weights; returns
  ``timing_s/weight_sync`` and ``weight_sync/bytes`` (what the engine copied);
- ``generate(requests, sampling)``: one completion per request;
- ``generate_chunk(requests, sampling, limits)``: the same with a token limit
  per request (async mode's partial rollouts);
- ``release()``: free what generation holds between rollouts (KV cache and,
  where the engine keeps a copy, its weights: vLLM's sleep on GPU; the views
  of a borrowed buffer for megatron);
- ``resume()``: take it back before the next update or generation.

What differs between engines is stated as data: ``borrows_weights`` (the
engine keeps views of the tensors it was given, so their buffer must live
until ``release``), ``loads_checkpoint`` (it can serve ``model_path`` as
loaded, without a weight source) and ``max_new_tokens`` (the longest
response it was built for, or None).

Three capabilities are sub-protocols an engine may add: ``AdapterServing``
(a LoRA actor's adapters served unmerged, ``update_adapters``),
``BucketLoading`` (the weights bucket by bucket, ``update_weights_in_buckets``)
and ``RequestServing`` (requests one by one behind the rollout server,
``serving_loop``).

Engines are registered by name with an import path and their traits
(``engine_traits.GeneratorTraits``), so building one imports its library only
then, and checking or planning one imports nothing:
``register_generator("sglang", "my_pkg.engine:Gen", GeneratorTraits(...))``
makes ``rollout.engine: sglang`` a valid setting. The class builds itself from
a ``GeneratorContext`` (``from_context``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Iterable, Protocol, runtime_checkable

import torch

from hybridengine.model.spec import ModelSpec
from hybridengine.reshard.plan import ReshardPlan
from workers.rollout.batch import Completion, GenerationRequest
from workers.rollout.engine_traits import MEGATRON_TRAITS, VLLM_TRAITS, GeneratorTraits
from workers.rollout.sampling import SamplingConfig

__all__ = ["AdapterServing", "BucketLoading", "Generator", "GeneratorBase", "GeneratorContext", "GeneratorTraits", "RequestServing",
           "build_generator", "generator_class", "generator_traits", "register_generator", "registered_generators",
           "loads_in_buckets", "serves_adapters"]


@dataclass(frozen=True)
class GeneratorContext:
    """Everything an engine may need to build itself on one rank."""

    model_path: str
    spec: ModelSpec  # the model as its shards arrive (vocabulary padded as the actor pads it)
    plan: ReshardPlan  # the generation layout over this rank's pool
    rank: int
    dtype: torch.dtype  # the dtype the shards arrive in
    config: Any  # the rollout's RolloutConfig
    eos_token_id: int
    pad_token_id: int
    decode: Callable[[list[int]], str]  # token ids -> text (stop strings)
    weights_pushed: bool  # weights arrive through update_weights; False: the engine serves model_path as loaded
    colocated: bool  # shares its processes (and devices) with the actor


@runtime_checkable
class Generator(Protocol):
    borrows_weights: bool
    loads_checkpoint: bool
    max_new_tokens: int | None
    accepts_partial_weights: bool  # update_weights may take only the tensors that changed (the rest kept)

    def update_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, Any]: ...

    def generate(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> list[Completion]: ...

    def generate_chunk(self, requests: list[GenerationRequest], sampling: SamplingConfig,
                       limits: list[int]) -> list[Completion]: ...

    def release(self) -> None: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class AdapterServing(Protocol):
    """An engine that serves a LoRA actor's adapters unmerged on the frozen base."""

    serves_adapters: bool  # built to serve adapters (a LoRA actor's rollout with lora_sync adapter)

    def update_adapters(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]: ...


@runtime_checkable
class BucketLoading(Protocol):
    """An engine that keeps its own copy of the weights and takes them bucket by bucket: each bucket's tensors
    are copied in before the next arrives (a bucket's tensors may be views of one reused buffer), so a sync
    holds one bucket beyond the engine's model (``rollout.weight_bucket_bytes``)."""

    def update_weights_in_buckets(self, buckets: Iterable[dict[str, torch.Tensor]]) -> dict[str, Any]: ...


def loads_in_buckets(generator: Generator) -> bool:
    """Whether ``generator`` takes its weights bucket by bucket (``BucketLoading``; never one that borrows them)."""
    return isinstance(generator, BucketLoading) and not generator.borrows_weights


@runtime_checkable
class RequestServing(Protocol):
    """An engine that serves requests one by one (the rollout server): its engine loop over these defaults."""

    def serving_loop(self, defaults: SamplingConfig) -> Any: ...


def serves_adapters(generator: Generator) -> bool:
    """Whether ``generator`` takes a LoRA actor's adapters unmerged (else they arrive merged in its weights)."""
    return isinstance(generator, AdapterServing) and bool(generator.serves_adapters)


class GeneratorBase:
    """Defaults an engine may keep: chunks by limit, nothing to release or resume."""

    borrows_weights: ClassVar[bool] = False
    loads_checkpoint: ClassVar[bool] = True
    max_new_tokens: int | None = None
    accepts_partial_weights: bool = False

    @classmethod
    def from_context(cls, context: GeneratorContext) -> "GeneratorBase":
        raise NotImplementedError(f"{cls.__name__} does not say how to build itself (from_context)")

    def generate_chunk(self, requests: list[GenerationRequest], sampling: SamplingConfig,
                       limits: list[int]) -> list[Completion]:
        """``generate`` with request i stopping after ``limits[i]`` tokens: one batch per distinct limit,
        the longest first."""
        if len(limits) != len(requests):
            raise ValueError(f"{len(limits)} limits for {len(requests)} requests")
        completions: list[Completion | None] = [None] * len(requests)
        for limit in sorted(set(limits), reverse=True):
            rows = [i for i, lim in enumerate(limits) if lim == limit]
            for i, done in zip(rows, self.generate([requests[i] for i in rows], replace(sampling, max_new_tokens=limit))):
                completions[i] = done
        return completions

    def release(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def close(self) -> None:
        pass


_ENGINES: dict[str, str | type] = {
    "vllm": "workers.rollout.vllm_engine:VLLMGenerator",
    "megatron": "workers.rollout.megatron_engine:MegatronGenerator",
}
_TRAITS: dict[str, GeneratorTraits] = {"vllm": VLLM_TRAITS, "megatron": MEGATRON_TRAITS}


def register_generator(name: str, engine: str | type, traits: GeneratorTraits | None = None) -> None:
    """Make ``rollout.engine: name`` build ``engine`` (a class, or its ``"module:Class"`` import path), with
    ``traits`` its capabilities (None: ``GeneratorTraits()``, the least an engine offers)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a generator's name must be a non-empty string, got {name!r}")
    if isinstance(engine, str) and ":" not in engine:
        raise ValueError(f"generator {name!r}: {engine!r} is not a 'module:Class' import path")
    if traits is not None and not isinstance(traits, GeneratorTraits):
        raise ValueError(f"generator {name!r}: traits must be a GeneratorTraits, got {type(traits).__name__}")
    _ENGINES[name] = engine
    _TRAITS[name] = traits or GeneratorTraits()


def registered_generators() -> tuple[str, ...]:
    return tuple(_ENGINES)


def generator_traits(name: str, strict: bool = True) -> GeneratorTraits:
    """What the engine registered as ``name`` can do (imports nothing of it). An unknown name raises, or with
    ``strict=False`` (a check that another check reports the name in) gives ``GeneratorTraits()``."""
    if name not in _TRAITS:
        if not strict:
            return GeneratorTraits()
        raise ValueError(f"rollout engine {name!r} is not one of {registered_generators()} "
                         f"(register one with workers.rollout.generator.register_generator)")
    return _TRAITS[name]


def generator_class(name: str) -> type:
    """The engine class registered as ``name`` (imported now)."""
    if name not in _ENGINES:
        raise ValueError(f"rollout engine {name!r} is not one of {registered_generators()} "
                         f"(register one with workers.rollout.generator.register_generator)")
    engine = _ENGINES[name]
    if isinstance(engine, str):
        module, _, attr = engine.partition(":")
        engine = getattr(importlib.import_module(module), attr)
    return engine


def build_generator(name: str, context: GeneratorContext) -> Generator:
    """The engine ``name``, built on this rank from ``context``; checked against the protocol."""
    generator = generator_class(name).from_context(context)
    missing = [m for m in ("update_weights", "generate", "generate_chunk", "release", "resume", "close")
               if not callable(getattr(generator, m, None))]
    if missing:
        raise TypeError(f"rollout engine {name!r} ({type(generator).__name__}) lacks {missing} of the generator protocol")
    return generator
