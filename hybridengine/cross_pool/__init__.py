"""The actor's weights sent to a generation pool of its own (separate processes, devices or nodes).

- ``plan``: each generation rank's segments and their routes, point-to-point
  or down a chain broadcast, whichever loads the busiest link less.
- ``transfer``: ``CrossPoolTransfer``, one per rank on either side, bucket
  by bucket over a process group that spans both pools.
"""
