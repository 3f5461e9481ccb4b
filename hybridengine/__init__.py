"""The 3D-HybridEngine: parallel layouts, device selection and (later) resharding.

Knows nothing of RL or Ray.
"""

from hybridengine.layout import MeshCoordinate, ParallelLayout

__all__ = ["MeshCoordinate", "ParallelLayout"]
