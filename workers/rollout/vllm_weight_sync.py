"""Per-rank weight shards into a running vLLM engine, through vLLM's own layerwise reload.

vLLM's stock ``reload_weights`` takes full checkpoint tensors and slices
them by TP rank, so every rank would need the whole model. The hybrid engine
already holds each rank's generation shard, so this loads the shard as is:
the layerwise reload steps restore each layer's parameters in checkpoint
format (per-rank shapes, on the meta device), we materialize them and copy
the shard in (vLLM's per-rank layout: ``qkv_proj`` = [q; k; v],
``gate_up_proj`` = [gate; up]), and vLLM's post-load processing runs per
layer (on CPU it repacks linear weights for oneDNN) before the result is
copied into the engine's original tensors. No rank ever holds more than its
shard plus one layer in checkpoint format.

These are vLLM internals (``workers.rollout.vllm_compat.layerwise_reload``
checks them); ``tests/rollout`` keeps a regression test that fails if they change.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from workers.rollout.vllm_compat import layerwise_reload
from workers.rollout.vllm_routes import VLLMRouteCapture

__all__ = ["ShardLoadError", "VLLMShardLoader"]


class ShardLoadError(ValueError):
    """The shard does not fit the engine's model: names, shapes or completeness."""


def _vocab_rows(layer: torch.nn.Module) -> tuple[int, int] | None:
    indices = getattr(layer, "shard_indices", None)
    if indices is None:
        return None
    return indices.org_vocab_start_index, indices.org_vocab_end_index


def _copy_into(name: str, target: torch.Tensor, tensor: torch.Tensor, rows, vocab_range) -> int:
    if rows is not None and target.dim() >= 1 and target.shape[1:] == tensor.shape[1:]:
        if vocab_range is not None and tuple(rows) != tuple(vocab_range):
            raise ShardLoadError(
                f"{name}: vLLM holds vocabulary rows {rows} on this rank, the shard has rows {tuple(vocab_range)}; "
                f"send the rows vLLM reports through vocab_rows() (workers.rollout.vocab_rows regroups them)"
            )
        count = rows[1] - rows[0]
        if tensor.shape[0] != count:
            raise ShardLoadError(f"{name}: shard has {tensor.shape[0]} vocabulary rows, vLLM holds {count} on this rank")
        target.data[:count].copy_(tensor)
        target.data[count:].zero_()  # vLLM's padding rows
        return tensor.numel() * tensor.element_size()
    if tuple(target.shape) != tuple(tensor.shape):
        raise ShardLoadError(f"{name}: shard has shape {tuple(tensor.shape)}, vLLM's per-rank parameter is {tuple(target.shape)}")
    target.data.copy_(tensor)
    return tensor.numel() * tensor.element_size()


def _reprocess_tied_layers(model: torch.nn.Module, loaded: set[str]) -> None:
    """Rerun post-load processing on layers that share a loaded tensor but were not loaded themselves.

    A tied ``lm_head`` holds the embedding's weight: the reload puts the new
    values in place, but on CPU the head also keeps a packed copy for its
    GEMM, made by its own post-load processing, which would otherwise still
    hold the old weights.
    """
    ptrs = {
        t.data_ptr() for name in loaded for t in model.get_submodule(name).parameters(recurse=False) if t.numel()
    }
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if name in loaded or method is None or not hasattr(method, "process_weights_after_loading"):
            continue
        if any(t.numel() and t.data_ptr() in ptrs for t in module.parameters(recurse=False)):
            method.process_weights_after_loading(module)


def _engine_name(name: str, expected: set[str]) -> str:
    """``name`` as the engine's model calls it: as is, a mixture of experts' fused tensor, the base layer
    of a layer vLLM wraps to serve LoRA adapters (``...qkv_proj.base_layer.weight``), or a vision-language
    model's language model (``language_model.model.layers...``)."""
    if name in expected:
        return name
    if f"language_model.{name}" in expected:
        return _engine_name(f"language_model.{name}", expected)
    module, _, param = name.rpartition(".")
    if f"{module}.base_layer.{param}" in expected:
        return f"{module}.base_layer.{param}"
    return _fused_experts_name(name, expected)


def _fused_experts_name(name: str, expected: set[str]) -> str:
    """The engine's name of a fused-experts tensor sent as ``...mlp.experts.w13_weight`` / ``w2_weight``: vLLM
    0.32's fused-experts layer keeps them one module deeper (``...mlp.experts.routed_experts.w13_weight``)."""
    prefix, _, leaf = name.rpartition(".")
    if leaf in ("w13_weight", "w2_weight") and f"{prefix}.routed_experts.{leaf}" in expected:
        return f"{prefix}.routed_experts.{leaf}"
    return name


class VLLMShardLoader(VLLMRouteCapture):
    """A vLLM worker extension: ``collective_rpc("load_shard", args=(shard, vocab_range))``, and a mixture of
    experts' routes (``capture_routes``, ``take_routes``: ``workers.rollout.vllm_routes``).

    Given as ``worker_extension_cls`` when the engine is built; vLLM mixes it
    into its worker class, so ``self`` is the worker and ``self.model_runner``
    holds the model.
    """

    def vocab_rows(self) -> tuple[int, int]:
        """[start, end) of the real vocabulary rows this rank's vocab-parallel layers hold."""
        for module in self.model_runner.model.modules():
            rows = _vocab_rows(module)
            if rows is not None:
                return rows
        raise ShardLoadError("the engine's model has no vocab-parallel layer")

    def load_shard(self, shard: dict[str, torch.Tensor], vocab_range: tuple[int, int] | None = None,
                   partial: bool = False) -> dict[str, Any]:
        """Copy ``shard`` (vLLM names, this rank's per-rank layout) into the model; returns bytes and time.

        ``vocab_range`` is the [start, end) of the vocabulary rows that the
        shard's embedding / output rows cover; it must be the range vLLM's
        vocab-parallel layers hold on this rank. ``partial``: the shard may
        hold only some parameters (those that changed; the rest stay as loaded).
        A shard that does not fit is refused before anything is copied.
        """
        expected = {name for name, _ in self.model_runner.model.named_parameters()}
        names = {_engine_name(name, expected) for name in shard}
        missing, unknown = [] if partial else sorted(expected - names), sorted(names - expected)
        if missing or unknown:
            raise ShardLoadError(
                f"the shard does not match the engine's parameters: missing {missing[:6]}, unknown {unknown[:6]} "
                f"(fused groups qkv_proj and gate_up_proj must be sent whole)"
            )
        self.begin_shard_load(partial)
        try:
            self.load_shard_bucket(shard, vocab_range)
        except BaseException:
            self._reload.close()
            raise
        return self.end_shard_load()

    def begin_shard_load(self, partial: bool = False) -> None:
        """Open one reload that ``load_shard_bucket`` fills bucket by bucket and ``end_shard_load`` finishes: the
        model's reload steps run once per sync, however many buckets it comes in. ``partial``: the buckets
        may together hold only some parameters; else they must be the whole shard, checked at the end."""
        model = self.model_runner.model
        self._expected = {name for name, _ in model.named_parameters()}  # as the model is now (tied tensors once)
        self._reload = contextlib.ExitStack()
        self._materialized = self._reload.enter_context(layerwise_reload(model, self.model_runner.model_config, partial))
        self._partial, self._loaded, self._copied, self._started = partial, set(), 0, time.perf_counter()

    def load_shard_bucket(self, shard: dict[str, torch.Tensor], vocab_range: tuple[int, int] | None = None) -> None:
        """One bucket of the shard into the open reload; a layer's tensors come in one bucket."""
        model, expected = self.model_runner.model, self._expected
        shard = {_engine_name(name, expected): tensor for name, tensor in shard.items()}
        unknown = sorted(set(shard) - expected)
        if unknown:
            raise ShardLoadError(f"the shard does not match the engine's parameters: unknown {unknown[:6]}")
        by_layer: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in shard.items():
            module_name, _, param_name = name.rpartition(".")
            by_layer.setdefault(module_name, []).append((param_name, tensor))
        for module_name, tensors in by_layer.items():
            layer = model.get_submodule(module_name)
            with self._materialized(layer):  # then post-load processing, and the copy into the kernel tensors
                rows = _vocab_rows(layer)
                for param_name, tensor in tensors:
                    target = getattr(layer, param_name)
                    self._copied += _copy_into(f"{module_name}.{param_name}", target, tensor, rows, vocab_range)
        self._loaded |= set(shard)

    def abort_shard_load(self) -> None:
        """Close an open reload that will not be finished (its stream failed)."""
        self._reload.close()

    def end_shard_load(self) -> dict[str, Any]:
        """Finish the reload ``begin_shard_load`` opened; the bytes copied and the seconds since it opened."""
        model = self.model_runner.model
        missing = [] if self._partial else sorted(self._expected - self._loaded)
        if missing:
            self._reload.close()
            raise ShardLoadError(
                f"the shard does not match the engine's parameters: missing {missing[:6]} (fused groups qkv_proj "
                f"and gate_up_proj must be sent whole)")
        self._reload.close()
        _reprocess_tied_layers(model, {name.rpartition(".")[0] for name in self._loaded})
        return {"bytes": self._copied, "seconds": time.perf_counter() - self._started}
