"""The parameters of one megatron pipeline stage at a TP size: names, shard shapes, shard kinds.

A reader of the parameter catalogue (``hybridengine.param_catalogue``),
kept under its historical name: the resharder uses it to know, for every
parameter of a generation stage, which training shards it is made of and
how they join.
"""

from __future__ import annotations

from hybridengine.param_catalogue import StageParam, stage_params

__all__ = ["StageParam", "stage_params"]
