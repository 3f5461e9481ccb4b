"""Loading the csrc op library (``torch.ops.hybridflow``), or falling back.

The extension ``hybridengine.ops._C`` registers every op at import. When it
is not built (a source checkout before ``make setup``, or a platform it does
not compile on), or ``HYBRIDFLOW_DISABLE_OPS=1`` is set, the Python wrappers
in this package run their torch reference implementations instead, and one
warning says so here, at import.
"""

from __future__ import annotations

import os
import warnings

import torch

from hybridengine.device.torch_compat import has_kernel_for

__all__ = ["DISABLE_ENV", "kernels_available", "kernels_on", "kernels_reason"]

DISABLE_ENV = "HYBRIDFLOW_DISABLE_OPS"


def _load() -> tuple[bool, str]:
    if os.environ.get(DISABLE_ENV) == "1":
        return False, f"{DISABLE_ENV}=1 is set"
    try:
        from hybridengine.ops import _C  # noqa: F401  (registers torch.ops.hybridflow.*)
    except ImportError as exc:
        return False, f"the extension hybridengine.ops._C is not built ({exc})"
    return True, "built"


_AVAILABLE, _REASON = _load()
if not _AVAILABLE:
    warnings.warn(
        f"hybridflow: custom kernels unavailable: {_REASON}; using the torch reference implementations "
        "(slower, and the fused log-prob ops materialise [tokens, vocab] tensors). Build the kernels with "
        "`make setup` or `python setup.py build_ext --inplace`.",
        stacklevel=2,
    )


def kernels_available() -> bool:
    """True when torch.ops.hybridflow holds the compiled kernels."""
    return _AVAILABLE


def kernels_reason() -> str:
    """Why the kernels are or are not in use, in words."""
    return _REASON


def kernels_on(device: torch.device) -> bool:
    """True when the compiled kernels cover tensors on ``device`` (CPU always; CUDA in CUDA builds)."""
    if not _AVAILABLE:
        return False
    if device.type == "cpu":
        return True
    return has_kernel_for("hybridflow::logit_stats", device.type.upper())
