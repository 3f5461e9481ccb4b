"""Dispatch modes: how a group call splits its input across ranks and gathers outputs.

A mode is a pair of pure functions. ``dispatch(view, args, kwargs)`` returns
one ``RankCall`` per rank (None for ranks that sit the call out) and a
context that ``collect(view, outputs, context)`` gets back with the outputs
of the ranks that ran. Neither touches a process or a transport, so every
rule is testable on its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.plan import GenerationMesh
from workers.data_proto import DataProto

__all__ = [
    "Dispatch",
    "DispatchError",
    "DispatchRule",
    "GroupView",
    "RankCall",
    "get_dispatch_rule",
    "register_dispatch_mode",
]


class Dispatch(str, enum.Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    MESH_COMPUTE_PROTO = "mesh_compute_proto"


class DispatchError(ValueError):
    """The input of a group call does not fit its dispatch mode; nothing was sent."""


class RankCall(NamedTuple):
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class GroupView:
    """What a dispatch rule may know about the group: its size and its model layout.

    ``layout`` is a training grid (``ParallelLayout``) or a generation grid
    (``GenerationMesh``); MESH_COMPUTE_PROTO uses either the same way.
    """

    world_size: int
    layout: ParallelLayout | GenerationMesh | None = None


DispatchFn = Callable[[GroupView, tuple, dict], tuple[list[RankCall | None], Any]]
CollectFn = Callable[[GroupView, dict[int, Any], Any], Any]


@dataclass(frozen=True)
class DispatchRule:
    name: str
    dispatch: DispatchFn
    collect: CollectFn


# ----------------------------------------------------------------- built-ins
def _dispatch_one_to_all(view: GroupView, args: tuple, kwargs: dict):
    return [RankCall(args, kwargs)] * view.world_size, None


def _collect_all(view: GroupView, outputs: dict[int, Any], _ctx: Any) -> list:
    return [outputs[rank] for rank in range(view.world_size)]


def _dispatch_all_to_all(view: GroupView, args: tuple, kwargs: dict):
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for label, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != view.world_size:
            got = f"length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            raise DispatchError(
                f"ALL_TO_ALL needs every argument to be a list with one item per rank "
                f"({view.world_size}); {label} is {got}"
            )
    calls = [
        RankCall(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(view.world_size)
    ]
    return calls, None


def _dispatch_rank_zero(view: GroupView, args: tuple, kwargs: dict):
    return [RankCall(args, kwargs)] + [None] * (view.world_size - 1), None


def _collect_rank_zero(view: GroupView, outputs: dict[int, Any], _ctx: Any) -> Any:
    return outputs[0]


def _split_protos(mode: str, args: tuple, kwargs: dict, parts: int):
    """Pad and chunk every DataProto argument into ``parts``; other arguments go to all parts."""
    protos = [a for a in list(args) + list(kwargs.values()) if isinstance(a, DataProto)]
    if not protos:
        raise DispatchError(f"{mode} needs at least one DataProto argument to split; got none")
    lengths = {len(p) for p in protos}
    if len(lengths) != 1:
        raise DispatchError(f"{mode}: DataProto arguments have different lengths {sorted(lengths)}")
    if lengths == {0}:
        raise DispatchError(f"{mode}: cannot split an empty DataProto across {parts} ranks")
    pad = 0

    def split(value: Any) -> list:
        nonlocal pad
        if not isinstance(value, DataProto):
            return [value] * parts
        padded, pad = value.pad_to_divisor(parts)
        return padded.chunk(parts)

    split_args = [split(a) for a in args]
    split_kwargs = {k: split(v) for k, v in kwargs.items()}
    calls = [
        RankCall(tuple(a[i] for a in split_args), {k: v[i] for k, v in split_kwargs.items()}) for i in range(parts)
    ]
    return calls, _Padding(pad, (lengths.pop() + pad) // parts)


class _Padding(NamedTuple):
    rows: int  # rows appended to the input so that it splits evenly
    rows_per_part: int


def _join_outputs(ordered: list[Any], padding: "_Padding") -> Any:
    """Concatenate DataProto outputs and drop what the padded input rows produced.

    A method may return a whole number k of rows per input row (k samples
    per prompt, say), consecutive per input row; the padding rows' outputs
    are then the last k * pad rows.
    """
    if not all(isinstance(o, DataProto) for o in ordered):
        return ordered
    per_row = {len(o) / padding.rows_per_part for o in ordered}
    if len(per_row) != 1 or not float(next(iter(per_row))).is_integer():
        raise DispatchError(
            f"outputs of {[len(o) for o in ordered]} rows for inputs of {padding.rows_per_part} rows per part: "
            f"a method must return the same whole number of rows per input row on every rank"
        )
    return DataProto.concat(ordered).unpad(padding.rows * int(per_row.pop()))


def _dispatch_dp_proto(view: GroupView, args: tuple, kwargs: dict):
    return _split_protos("DP_COMPUTE_PROTO", args, kwargs, view.world_size)


def _collect_dp_proto(view: GroupView, outputs: dict[int, Any], pad: _Padding) -> Any:
    return _join_outputs([outputs[r] for r in range(view.world_size)], pad)


def _mesh_layout(view: GroupView) -> ParallelLayout | GenerationMesh:
    if view.layout is None:
        raise DispatchError(
            "MESH_COMPUTE_PROTO needs the group's parallel layout, and its workers have not set one; "
            "call self.set_layout(ParallelLayout(...)) when the worker builds its model"
        )
    if view.layout.world_size != view.world_size:
        raise DispatchError(
            f"worker layout {view.layout} covers {view.layout.world_size} ranks but the group has {view.world_size}"
        )
    return view.layout


def _dispatch_mesh_proto(view: GroupView, args: tuple, kwargs: dict):
    layout = _mesh_layout(view)
    per_replica, pad = _split_protos("MESH_COMPUTE_PROTO", args, kwargs, layout.data_replicas)
    # Every rank of one model replica (its TP x PP ranks, and its CP group's) gets the same chunk.
    calls = [per_replica[layout.data_rank(rank)] for rank in range(view.world_size)]
    return calls, pad


def _collect_mesh_proto(view: GroupView, outputs: dict[int, Any], pad: _Padding) -> Any:
    layout = _mesh_layout(view)
    by_replica = {layout.data_rank(r): outputs[r] for r in outputs if layout.is_collect_rank(r)}
    return _join_outputs([by_replica[d] for d in range(layout.data_replicas)], pad)


_RULES: dict[str, DispatchRule] = {
    rule.name: rule
    for rule in (
        DispatchRule(Dispatch.ONE_TO_ALL.value, _dispatch_one_to_all, _collect_all),
        DispatchRule(Dispatch.ALL_TO_ALL.value, _dispatch_all_to_all, _collect_all),
        DispatchRule(Dispatch.RANK_ZERO.value, _dispatch_rank_zero, _collect_rank_zero),
        DispatchRule(Dispatch.DP_COMPUTE_PROTO.value, _dispatch_dp_proto, _collect_dp_proto),
        DispatchRule(Dispatch.MESH_COMPUTE_PROTO.value, _dispatch_mesh_proto, _collect_mesh_proto),
    )
}


def register_dispatch_mode(name: str, dispatch: DispatchFn, collect: CollectFn) -> DispatchRule:
    """Add a user dispatch/collect pair under ``name``; use it as ``@register("name")``."""
    if name in {m.value for m in Dispatch}:
        raise ValueError(f"{name!r} is a built-in dispatch mode and cannot be replaced")
    rule = DispatchRule(name, dispatch, collect)
    _RULES[name] = rule
    return rule


def get_dispatch_rule(mode: Dispatch | str) -> DispatchRule:
    name = mode.value if isinstance(mode, Dispatch) else str(mode)
    try:
        return _RULES[name]
    except KeyError:
        raise ValueError(f"unknown dispatch mode {name!r}; known modes: {sorted(_RULES)}") from None
