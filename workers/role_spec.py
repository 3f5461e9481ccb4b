"""RoleSpec: a role declared now and built later, on whatever processes the controller places it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from workers.keywords import check_constructor

__all__ = ["RoleSpec"]


@dataclass(frozen=True)
class RoleSpec:
    """A worker class and its constructor arguments, e.g. ``Actor.from_pretrained(path, tensor_parallel=2)``.

    Nothing is loaded until a controller builds a worker group from it, so a
    spec is cheap to write, pass around and change (``with_parallelism``). Its config sections are typed
    (``engine``: an ``EngineConfig``, ``config``: a ``RolloutConfig``, ...): one given as a dict is built and
    checked here, and the worker's constructor takes it as it is.
    """

    worker_cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    # "auto": the planner picks the fastest layout that fits the job's devices (controller.planner.device_map),
    # where the user set none: tensor_parallel / pipeline_parallel given explicitly win
    device_map: str | None = None
    explicit_parallelism: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kwargs", check_constructor(self.worker_cls, self.kwargs,
                                                             f"RoleSpec({self.worker_cls.__name__})"))
        if self.device_map not in (None, "auto"):
            raise ValueError(f"device_map {self.device_map!r} is not supported; valid: 'auto' (the controller places "
                             f"the role on the job's devices) or None")

    def with_parallelism(self, tensor_parallel: int | None = None, pipeline_parallel: int | None = None) -> "RoleSpec":
        sizes = {name: size for name, size in (("tensor_parallel", tensor_parallel),
                                               ("pipeline_parallel", pipeline_parallel)) if size is not None}
        engine = self.kwargs.get("engine")
        engine = replace(engine, **sizes) if engine is not None else sizes  # (a dict: typed by __post_init__)
        return replace(self, kwargs={**self.kwargs, "engine": engine}, explicit_parallelism=True)

    @property
    def model_path(self) -> str | None:
        return self.kwargs.get("model_path")
