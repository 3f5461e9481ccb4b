"""Where and how a DataFlow node runs, declared on its function with decorators.

    @register_placement("actor", devices=["cuda:0", "cuda:1"])
    @register_parallelism("actor", strategy="TP")
    def hf_actor_generate(prompts): ...

    @register_placement("reward_model", devices=["cuda:2"])
    def score(responses): ...

- ``register_placement(name, devices)``: the node runs in a worker group of its own, one process per
  device: ``"cuda:N"`` is GPU N, ``"cpu"`` / ``"cpu:N"`` a CPU process (N only tells processes apart).
- ``register_parallelism(name, strategy)``: ``"DP"`` (the default) splits the node's input across its
  processes and joins their outputs in order; ``"TP"`` gives every process the same input, inside one
  process group that the function reaches with ``hybridflow.node_context()``, and keeps rank 0's output.
- ``register_protocol(name, split=..., gather=...)``: how the input is split (``"chunk"``: in contiguous
  parts, one per process; ``"broadcast"``: whole to each) and the outputs gathered (``"concat"``,
  ``"rank0"``, or ``"all"``: the list of every rank's output). A strategy sets both; a protocol wins.

The declarations are data on the function (``node_declaration(func)``); ``DataFlow`` reads them when it
is built and checks the devices against the machine before any process starts. ``name`` must be the
node's name. The same declarations on an ``RLTrainer`` are its ``register_placement`` /
``register_parallelism`` methods.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NodeDeclaration", "STRATEGIES", "check_devices", "node_declaration", "register_parallelism",
           "register_placement", "register_protocol"]

STRATEGIES = {"DP": ("chunk", "concat"), "TP": ("broadcast", "rank0")}
SPLITS = ("chunk", "broadcast")
GATHERS = ("concat", "rank0", "all")
_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
_ATTRIBUTE = "__hybridflow_node__"


@dataclass(frozen=True)
class NodeDeclaration:
    name: str
    devices: tuple[str, ...] | None = None  # None: the node runs in the driver
    strategy: str = "DP"
    split: str | None = None  # None: the strategy's
    gather: str | None = None

    @property
    def protocol(self) -> tuple[str, str]:
        split, gather = STRATEGIES[self.strategy]
        return self.split or split, self.gather or gather

    @property
    def accelerator(self) -> bool:
        return bool(self.devices) and self.devices[0].startswith("cuda")


def node_declaration(func: Callable) -> NodeDeclaration | None:
    return getattr(func, _ATTRIBUTE, None)


def _declare(name: str, func: Callable, **fields: Any) -> Callable:
    if not callable(func):
        raise TypeError(f"register_*({name!r}) decorates a node's function, got {func!r}")
    earlier = node_declaration(func)
    if earlier is not None and earlier.name != name:
        raise ValueError(f"{getattr(func, '__name__', func)!r} is declared as node {earlier.name!r} and as {name!r}; "
                         f"one function is one node")
    declaration = dataclasses.replace(earlier or NodeDeclaration(name), **fields)
    try:
        setattr(func, _ATTRIBUTE, declaration)
    except AttributeError:  # a bound method or builtin: wrap it
        def node(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        node.__name__ = getattr(func, "__name__", "node")
        setattr(node, _ATTRIBUTE, declaration)
        return node
    return func


def check_devices(devices: Sequence[str], where: str) -> tuple[str, ...]:
    """The device strings, checked in form (``cpu``, ``cpu:N``, ``cuda:N``; one kind per node, no repeats)."""
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(f"{where}: devices must be a non-empty list like ['cuda:0', 'cuda:1'] or ['cpu:0'], "
                         f"got {devices!r}")
    bad = [d for d in devices if not isinstance(d, str) or not _DEVICE.match(d)]
    if bad:
        raise ValueError(f"{where}: device(s) {bad} are not 'cpu', 'cpu:N' or 'cuda:N'")
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) > 1:
        raise ValueError(f"{where}: devices {list(devices)} mix CPU and GPU; a node runs on one kind")
    if "cuda" in kinds and any(":" not in d for d in devices):
        raise ValueError(f"{where}: name each GPU as 'cuda:N', got {list(devices)}")
    repeated = sorted({d for d in devices if devices.count(d) > 1 and d != "cpu"})
    if repeated:
        raise ValueError(f"{where}: device(s) {repeated} listed twice")
    return tuple(devices)


def register_placement(name: str, devices: Sequence[str]) -> Callable[[Callable], Callable]:
    """Run node ``name`` on ``devices``, one process each (see the module docstring)."""
    devices = check_devices(devices, f"register_placement({name!r})")
    return lambda func: _declare(name, func, devices=devices)


def register_parallelism(name: str, strategy: str = "DP") -> Callable[[Callable], Callable]:
    """Split node ``name``'s work across its processes as ``strategy`` ("DP" or "TP")."""
    if strategy not in STRATEGIES:
        raise ValueError(f"register_parallelism({name!r}): strategy {strategy!r} is not one of {sorted(STRATEGIES)}")
    return lambda func: _declare(name, func, strategy=strategy)


def register_protocol(name: str, split: str | None = None, gather: str | None = None) -> Callable[[Callable], Callable]:
    """How node ``name``'s input is split across its processes and their outputs gathered."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"register_protocol({name!r}): split {split!r} is not one of {SPLITS}")
    if gather is not None and gather not in GATHERS:
        raise ValueError(f"register_protocol({name!r}): gather {gather!r} is not one of {GATHERS}")
    return lambda func: _declare(name, func, split=split, gather=gather)
