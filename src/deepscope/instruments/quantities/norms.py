"""GradNorm, Distance and UpdateSize: L2 norms per parameter tensor and in total."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def with_total(per_layer: Tensor) -> Tensor:
    """Append the sum over layers as a last row: (K, *rest) -> (K + 1, *rest)."""
    return torch.cat([per_layer, per_layer.sum(0, keepdim=True)])


def squared_norms(tensors: Sequence[Tensor]) -> Tensor:
    """‖t⁽ᵏ⁾‖₂² of each tensor as float64, shape (K,), on the first one's device.

    Each norm accumulates in float32 (float64 for float64 tensors) without a float64 copy
    of the tensor (a norm has no cancellation); squares and sums over tensors are float64.

    Raises:
        ValueError: if `tensors` is empty.
    """
    if not tensors:
        raise ValueError("squared_norms needs at least one tensor; got an empty sequence")
    device = tensors[0].device
    return torch.stack([
        torch.linalg.vector_norm(t, dtype=_accumulator(t.dtype)).to(device, torch.float64).square()
        for t in tensors
    ])


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def layer_norms(tensors: Sequence[Tensor]) -> Tensor:
    """‖t⁽ᵏ⁾‖₂ per tensor, then the total √Σₖ‖t⁽ᵏ⁾‖²; float64, shape (K + 1,).

    GradNorm takes the mean gradients ḡ⁽ᵏ⁾, Distance θₜ⁽ᵏ⁾ − θ₀⁽ᵏ⁾, UpdateSize
    dₜ⁽ᵏ⁾ = θₜ₊₁⁽ᵏ⁾ − θₜ⁽ᵏ⁾; the result is in the tensors' units.
    """
    return with_total(squared_norms(tensors)).sqrt()
