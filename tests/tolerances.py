"""Tolerances derived from what a comparison computes, not picked by hand (docs/contributing.md, "Tolerances").

Two fp32 computations of the same sum in different orders (another TP layout's reduction, another CPU's vector
width, PEFT's loop against megatron's fused linears) differ by rounding alone. For a sum of n terms, each
rounding moves the partial sum by at most the unit roundoff u = eps / 2 of its magnitude, so the two results
are within n * u * sum(|terms|) of each other (Higham, "Accuracy and Stability of Numerical Algorithms",
section 3.1); a chain of sums (a backward pass) adds its lengths. An element that cancels (a small gradient
made of large terms) keeps the error of its terms' scale, so the bound is on the tensor's scale, not on each
element's own value.
"""

from __future__ import annotations

import torch

__all__ = ["summation_tolerance"]


def summation_tolerance(reduction_length: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """The most two orders of summing ``reduction_length`` terms of magnitude up to ``scale`` can differ by in
    ``dtype``: n * u * scale, u = eps / 2."""
    return reduction_length * torch.finfo(dtype).eps / 2 * scale
