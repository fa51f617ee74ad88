"""Exact Hessian diagonal and dense Hessian from D Hessian-vector products (small models)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from .estimate import Estimate
from .operator import HessianOperator, check_int, check_operator


def exact_diagonal(op: HessianOperator, max_dim: int = 5000) -> Estimate:
    """diag(H) exactly, from H e_d for every unit vector e_d.

    Costs D HVPs, batched ``op.batch_size`` at a time in vmapped backward passes; memory
    stays O(batch_size · D) as only each block's diagonal is kept.

    Returns:
        Estimate with a detached flat (D,) tensor (loss units per parameter unit squared),
        estimator "exact", samples = D.

    Raises:
        ValueError: if D > max_dim.
    """
    op = check_operator(op)
    diagonal = torch.empty(op.dim, dtype=op.dtype, device=op.device)
    for start, rows in _unit_blocks(op, max_dim, "exact_diagonal"):
        idx = torch.arange(rows.shape[0], device=op.device)
        diagonal[start : start + rows.shape[0]] = rows[idx, start + idx]
    return Estimate(diagonal, "exact", op.dim)


def dense_hessian(op: HessianOperator, max_dim: int = 5000) -> Tensor:
    """The full Hessian, shape (D, D), row d = H e_d; for small models and tests.

    Costs D HVPs and D² memory. Not symmetrised, so asymmetry shows round-off.

    Raises:
        ValueError: if D > max_dim.
    """
    op = check_operator(op)
    return torch.cat([rows for _, rows in _unit_blocks(op, max_dim, "dense_hessian")])


def _unit_blocks(op: HessianOperator, max_dim: int, caller: str) -> Iterator[tuple[int, Tensor]]:
    """Yield (start, H E) for consecutive blocks E of unit vectors e_start, e_start+1, ..."""
    check_int("max_dim", max_dim, 1)
    if op.dim > max_dim:
        raise ValueError(
            f"{caller}: the model has D={op.dim} parameters, more than max_dim={max_dim}; "
            "pass a larger max_dim (D HVPs) or use hutchinson_diagonal(op) instead"
        )
    for start in range(0, op.dim, op.batch_size):
        n = min(op.batch_size, op.dim - start)
        units = torch.zeros(n, op.dim, dtype=op.dtype, device=op.device)
        idx = torch.arange(n, device=op.device)
        units[idx, start + idx] = 1
        yield start, op.matmat(units)
