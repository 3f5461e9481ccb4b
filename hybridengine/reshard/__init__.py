"""Colocated resharding: the training layout's shards -> the generation layout's, on the same ranks.

- ``plan``: which generation layouts are reachable from a training layout,
  and, per rank, its generation coordinates and its micro-DP group.
- ``schedule``: the micro-DP gather as a few precomputed collectives.
- ``resharder``: the executor (``Resharder``), reused every step.
- ``baselines``: the two whole-model gathers it is measured against.
- ``transport``: the collectives the executors use, counting bytes.
- ``generation_export``: full Hugging Face tensors from generation shards.
"""
