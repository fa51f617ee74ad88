"""The result type every curvature estimator returns, and per-layer splitting."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .operator import HessianOperator, check_operator


@dataclass
class Estimate:
    """One curvature estimate and how it was obtained.

    value:     a Python float (an eigenvalue or a trace, in loss units per parameter unit
               squared), or a detached flat tensor of shape (D,) for a diagonal, on the
               operator's device and in its dtype.
    estimator: "lanczos", "power_iteration", "hutchinson", "hutch++" or "exact".
    samples:   Hessian-vector products spent (for Hutchinson: probe vectors, one each).
    """

    value: float | Tensor
    estimator: str
    samples: int


def layer_traces(op: HessianOperator, diagonal: Tensor) -> list[float]:
    """Per-parameter-tensor traces: the sum of each parameter's segment of a (D,) diagonal.

    ``diagonal`` is e.g. ``exact_diagonal(op).value`` or ``hutchinson_diagonal(op).value``;
    the result has one float per tensor in ``op.params``, in order.
    """
    if isinstance(diagonal, Estimate):
        raise TypeError("diagonal must be a tensor; pass estimate.value, not the Estimate")
    check_operator(op)
    return torch.stack([seg.sum() for seg in op.split(diagonal)]).tolist()
