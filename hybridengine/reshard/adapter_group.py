"""LoRA adapters as a parameter group of the weight plan: every generation rank wants each adapter whole.

An adapter on a projection (the catalogue's ``projections``: q_proj ... down_proj) is a pair A [r, in] and
B [out, r]. Its geometry follows its base's: TP cuts a column-parallel linear's output rows, so each rank
holds its rows of B (its heads, query groups or FFN rows) and all of A; a row-parallel linear's input
columns, so its columns of A and all of B. Each training rank of a stage holds its TP cut of the stage's
adapters; the data-parallel ranks hold copies.

A receiver wants every adapter whole (a copying engine merges them into its generation shard, cut as it
cuts the weight; an engine that serves adapters takes them whole), so it receives exactly what it does
not hold: the other TP ranks' cuts of its stage's adapters, and the other stages' adapters whole.
Across pools (``gathered``) the adapters are whole on training rank 0, which sends them to every
generation rank.

Whole adapters are named ``layers.{layer}.{linear}.lora_{A|B}.{part}`` (``whole_name``); on a training
rank they are the parameters ``workers.megatron.lora`` attaches, ``decoder.layers.{i}.{linear}.lora.lora_{A|B}.{part}``.
"""

from __future__ import annotations

from typing import NamedTuple

from hybridengine.model.catalogue import REPLICATED, projections
from hybridengine.model.geometry import ShardGeometry
from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout
from hybridengine.reshard.pieces import Holding, Need, PieceGroup, PiecePlan, Want, plan_pieces

__all__ = ["AdapterGroup", "AdapterKey", "plan_adapters", "whole_name"]

_CUT_A = ShardGeometry("lora_A", dim=1)  # a row-parallel linear's A: its input columns
_CUT_B = ShardGeometry("lora_B", dim=0)  # a column-parallel linear's B: its output rows


class AdapterKey(NamedTuple):
    """The A or B (``side``) of the adapter on part ``part`` of megatron linear ``linear`` in model layer ``layer``."""

    layer: int
    linear: str
    part: str
    side: str


def whole_name(key: AdapterKey) -> str:
    return f"layers.{key.layer}.{key.linear}.lora_{key.side}.{key.part}"


class AdapterGroup(PieceGroup):
    """The rank-``rank`` adapters on ``targets`` (HF projection names) of ``spec`` trained at ``train``, for
    ``receivers`` generation ranks; ``gathered``: whole on training rank 0 (across pools)."""

    kind, label = "adapters", "lora"

    def __init__(self, spec: ModelSpec, train: ParallelLayout, rank: int, targets: tuple[str, ...], receivers: int,
                 gathered: bool = False) -> None:
        self.spec, self.train, self.rank, self.receivers, self.gathered = spec, train, rank, receivers, gathered
        shapes = projections(spec)
        self.projections = {(shapes[t].linear, shapes[t].part): shapes[t] for t in targets}
        self.keys = tuple(AdapterKey(layer, linear, part, side) for layer in range(spec.num_layers)
                          for linear, part in self.projections for side in ("A", "B"))

    def _cut(self, key: AdapterKey) -> bool:
        """Whether TP cuts this side (a row linear's A, a column linear's B); the other is whole on every rank."""
        return self.projections[key.linear, key.part].row_parallel == (key.side == "A")

    def _length(self, key: AdapterKey) -> int:
        projection = self.projections[key.linear, key.part]
        return projection.fan_in if key.side == "A" else projection.fan_out

    def wants(self, receiver: int) -> list[Want]:
        return [Want(key, key, (0, self._length(key) if self._cut(key) else 1)) for key in self.keys]

    def holdings(self, key: AdapterKey) -> list[Holding]:
        train = self.train
        if self.gathered:
            return [Holding((0, self._length(key) if self._cut(key) else 1), (0,))]
        stage = self.spec.stage_of_layer(key.layer, train.pp)[0]
        if not self._cut(key):
            return [Holding((0, 1), tuple(train.rank_of(t, stage, d) for d in range(train.dp) for t in range(train.tp)))]
        width = self._length(key) // train.tp
        return [Holding((t * width, (t + 1) * width), tuple(train.rank_of(t, stage, d) for d in range(train.dp)))
                for t in range(train.tp)]

    def geometries(self, key: AdapterKey) -> tuple[ShardGeometry, ...]:
        if not self._cut(key):
            return (REPLICATED,)
        return (_CUT_A,) if key.side == "A" else (_CUT_B,)

    def shapes(self, key: AdapterKey, units: int) -> tuple[tuple[int, ...], ...]:
        length = units if self._cut(key) else self._length(key)
        return ((self.rank, length),) if key.side == "A" else ((length, self.rank),)

    def unit_numel(self, key: AdapterKey) -> int:
        return self.rank if self._cut(key) else self.rank * self._length(key)

    def training_names(self, train_rank: int, key: AdapterKey) -> tuple[str, ...]:
        if self.gathered:
            return (whole_name(key),)
        stage = self.train.coordinate(train_rank).pp_rank
        local = self.spec.layers_of_stage(stage, self.train.pp).index(key.layer)
        return (f"decoder.layers.{local}.{key.linear}.lora.lora_{key.side}.{key.part}",)

    def generation_names(self, receiver: int, need: Need) -> tuple[str, ...]:
        return (whole_name(need.key),)

    def whole(self, named: dict) -> dict:
        """Whole adapters by name -> by (layer, linear, part) -> (A, B)."""
        return {(k.layer, k.linear, k.part): (named[whole_name(k)], named[whole_name(k._replace(side="B"))])
                for k in self.keys if k.side == "A"}

    def named(self, whole: dict) -> dict:
        """``whole``'s inverse: (layer, linear, part) -> (A, B) as whole adapters by name."""
        return {whole_name(k): whole[k.layer, k.linear, k.part][0 if k.side == "A" else 1] for k in self.keys}


def plan_adapters(spec: ModelSpec, train: ParallelLayout, rank: int, targets: tuple[str, ...], receivers: int | None = None,
                  gathered: bool = False) -> PiecePlan:
    """The adapters' piece plan: colocated (every training rank receives them whole), or (``receivers``,
    ``gathered``) across pools from training rank 0."""
    colocated = receivers is None
    group = AdapterGroup(spec, train, rank, targets, train.world_size if colocated else receivers, gathered)
    return plan_pieces(group, group.receivers, colocated)
