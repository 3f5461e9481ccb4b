"""EngineRole: what every role on the megatron engine offers besides its own work."""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridengine.model.spec import ModelSpec
from workers.base_worker import BaseWorker
from workers.dispatch import Dispatch
from workers.megatron.checkpoint import load_checkpoint, save_checkpoint
from workers.megatron.config import EngineConfig, OptimConfig
from workers.megatron.engine import MegatronEngine
from workers.megatron.lora import LoRAConfig, check_lora
from workers.keywords import check_constructor
from workers.pretrained import resolve_pretrained
from workers.register import register
from workers.role_spec import RoleSpec

__all__ = ["EngineRole"]


class EngineRole(BaseWorker):
    engine: MegatronEngine
    update_count: int = 0  # PPO updates taken; seeds each update's mini-batch shuffle

    @classmethod
    def from_pretrained(
        cls, model_path: str, tensor_parallel: int | None = None, pipeline_parallel: int | None = None,
        micro_batch_size: int = 1, device_map: str | None = None, **kwargs: Any
    ) -> RoleSpec:
        """Declare this role on an HF checkpoint (a directory or a hub id); a controller builds it later.

        Other keyword arguments go to the role's constructor (``optim=``, ``ppo=``, ...); an unknown one,
        or a bad value in a config section, is refused here. ``device_map="auto"``: the planner picks
        the fastest TP x PP that fits the job's devices (``controller.planner.device_map``) unless ``tensor_parallel`` /
        ``pipeline_parallel`` are given; without it they default to 1.
        """
        kwargs = cls.declared_in_code(kwargs)
        given = kwargs.pop("engine", None)  # a dict of EngineConfig fields or an EngineConfig
        sizes = {"tensor_parallel": tensor_parallel or 1, "pipeline_parallel": pipeline_parallel or 1,
                 "micro_batch_size": micro_batch_size}
        engine = dataclasses.replace(given, **sizes) if isinstance(given, EngineConfig) else {**(given or {}), **sizes}
        typed = check_constructor(cls, {"model_path": model_path, "engine": engine, **kwargs},
                                  f"{cls.__name__}.from_pretrained")
        typed["model_path"] = resolve_pretrained(model_path, missing_ok=True)  # a hub id: its cached snapshot, now
        return RoleSpec(cls, typed, device_map=device_map,
                        explicit_parallelism=tensor_parallel is not None or pipeline_parallel is not None)

    @classmethod
    def declared_in_code(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``from_pretrained``'s keywords with the role's defaults for a declaration in code (none here)."""
        return kwargs

    def _build_engine(
        self, model_path: str, engine: EngineConfig | None, optim: OptimConfig | None, value_model: bool = False,
        lora: LoRAConfig | None = None, freeze_vision_tower: bool = True,
    ) -> None:
        spec = ModelSpec.from_pretrained(model_path)  # checked before any megatron group forms
        if spec.is_value_model != value_model:
            wanted = "a sequence-classification checkpoint with a value head" if value_model else "a causal LM checkpoint"
            raise ValueError(f"{type(self).__name__} needs {wanted}; {model_path} is a {spec.architecture}")
        lora = lora or LoRAConfig()
        check_lora(spec, lora)  # named problems (targets, rank) before any megatron group forms
        if not freeze_vision_tower and spec.vision is None:
            raise ValueError(f"freeze_vision_tower false: {model_path} ({spec.architecture}) has no vision tower")
        self.engine = MegatronEngine(model_path, engine or EngineConfig(), self.world_size, optim,
                                     self.process_group, lora, freeze_vision_tower)
        self.set_layout(self.engine.grid)  # rows go to each replica; a CP group shares its rows

    @register(Dispatch.ONE_TO_ALL)
    def save_hf(self, path: str, precision: str | None = None) -> str:
        """Write the current weights as a Hugging Face checkpoint directory, in ``precision`` (None: the engine's)."""
        self.engine.export_hf(path, precision)
        return path

    @register(Dispatch.ONE_TO_ALL)
    def save_peft(self, path: str) -> str:
        """Write the LoRA adapters as a PEFT adapter directory (``peft.PeftModel.from_pretrained`` loads it)."""
        self.engine.export_peft(path)
        return path

    @register(Dispatch.ONE_TO_ALL)
    def state_bytes(self) -> dict[str, int]:
        """This rank's model state in bytes, from its tensors: weights, gradients, optimizer (one dict per rank)."""
        return self.engine.state_bytes()

    @register(Dispatch.ONE_TO_ALL)
    def saved_activation_bytes(self, batch) -> dict[str, int]:
        """The activations one micro-batch of ``batch`` keeps for backward on each rank (PP 1): bytes, rows, seq_len."""
        return self.engine.saved_activation_bytes(batch)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, step: int, extra: dict[str, Any] | None = None) -> str:
        """Model, optimizer, LR schedule, RNG and counters as ``root/step_<step>``, atomically."""
        extra = {**(extra or {}), "update_count": self.update_count}
        return str(save_checkpoint(self.engine, root, step, extra))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore from a checkpoint directory, or from the newest one under a root; at any TP/PP."""
        extra = load_checkpoint(self.engine, path)
        self.update_count = int(extra.get("update_count", 0))
        return extra
