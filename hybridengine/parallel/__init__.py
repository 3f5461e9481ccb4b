"""Parallel grids and their process groups.

- ``layout``: ``ParallelLayout`` (TP fastest, then DP, then PP, as megatron
  numbers ranks) and ``MeshCoordinate``.
- ``process_groups``: subgroups that only their members create, kept per
  rank set.
"""
