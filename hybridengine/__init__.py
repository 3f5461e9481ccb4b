"""The 3D-HybridEngine: a model's weights moved between parallel layouts at the lower bound of bytes.

Knows nothing of RL, of Ray or of the roles that use it. Imports point down
the list below (``reshard`` and ``cross_pool`` read ``model`` and
``parallel``; nothing here imports ``workers`` or ``controller``).

- ``compat``: the version guard of every library's compat module (here
  torch's; megatron-core's, vLLM's and Ray's in ``workers`` and
  ``controller``).
- ``parallel``: the training grid (``ParallelLayout``: TP x DP x PP in
  megatron's rank order) and subgroups only their members create.
- ``model``: what is being moved: the model's description (``ModelSpec``),
  the catalogue of its parameters with each one's shard geometry, and the
  Hugging Face and vLLM layouts read from it.
- ``reshard``: colocated resharding, training layout -> generation layout on
  the same ranks: the plan, the gather schedule, the executor
  (``Resharder``), the baselines it is measured against, and transports.
- ``cross_pool``: the same weights sent to a generation pool of its own:
  the plan (point-to-point or chain broadcast) and the transfer.
- ``device``: the one place that names a device type or a collective
  backend (CUDA/NCCL or CPU/gloo), and torch's patches (``torch_compat``:
  the CPU path's emulation of ``torch.cuda`` among them).
- ``ops``: the csrc op library's Python side (fused log-probs, the advantage
  scan, block copies).
"""

from hybridengine.parallel.layout import MeshCoordinate, ParallelLayout

__all__ = ["MeshCoordinate", "ParallelLayout"]
