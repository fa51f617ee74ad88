"""Exact Hessian diagonal and dense Hessian from D Hessian-vector products (small models)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from torch import Tensor

from .estimate import Estimate
from .operator import HessianOperator, check_int, check_operator


class OverBudget(RuntimeError):
    """`exact_diagonal` gave up: its D HVPs would take longer than the time it was given.

    projected_s: the whole diagonal's projected seconds, from the blocks done so far.
    """

    def __init__(self, projected_s: float, budget_s: float) -> None:
        super().__init__(f"the exact diagonal would take about {projected_s:.3g} s, more than "
                         f"its budget of {budget_s:.3g} s")
        self.projected_s = projected_s


def exact_diagonal(op: HessianOperator, max_dim: int = 5000,
                   budget_s: float | None = None) -> Estimate:
    """diag(H) exactly, from H e_d for every unit vector e_d.

    Costs D HVPs, batched ``op.batch_size`` at a time in vmapped backward passes; memory
    stays O(batch_size · D) as only each block's diagonal is kept.

    budget_s: seconds it may take. Blocks then start at 2 HVPs and double up to
        ``op.batch_size``; after each block the time of all D HVPs is projected from the
        blocks done, and when it exceeds the budget the computation stops (having cost
        about the budget at most, plus the last block: no more than all blocks before it).

    Returns:
        Estimate with a detached flat (D,) tensor (loss units per parameter unit squared),
        estimator "exact", samples = D.

    Raises:
        ValueError: if D > max_dim.
        OverBudget: if the projected time exceeds budget_s.
    """
    op = check_operator(op)
    diagonal = torch.empty(op.dim, dtype=op.dtype, device=op.device)
    began = time.perf_counter()
    first = 2 if budget_s is not None else op.batch_size
    for start, rows in _unit_blocks(op, max_dim, "exact_diagonal", first):
        idx = torch.arange(rows.shape[0], device=op.device)
        diagonal[start : start + rows.shape[0]] = rows[idx, start + idx]
        done = start + rows.shape[0]
        if budget_s is not None and done < op.dim:
            diagonal[done - 1].item()  # waits for the device: the blocks' time, not launch
            projected = (time.perf_counter() - began) * op.dim / done
            if projected > budget_s:
                raise OverBudget(projected, budget_s)
    return Estimate(diagonal, "exact", op.dim)


def dense_hessian(op: HessianOperator, max_dim: int = 5000) -> Tensor:
    """The full Hessian, shape (D, D), row d = H e_d; for small models and tests.

    Costs D HVPs and D² memory. Not symmetrised, so asymmetry shows round-off.

    Raises:
        ValueError: if D > max_dim.
    """
    op = check_operator(op)
    return torch.cat([rows for _, rows in _unit_blocks(op, max_dim, "dense_hessian")])


def _unit_blocks(op: HessianOperator, max_dim: int, caller: str,
                 first: int | None = None) -> Iterator[tuple[int, Tensor]]:
    """Yield (start, H E) for consecutive blocks E of unit vectors e_start, e_start+1, ...;
    blocks of op.batch_size, or from `first` doubling up to op.batch_size."""
    check_int("max_dim", max_dim, 1)
    if op.dim > max_dim:
        raise ValueError(
            f"{caller}: the model has D={op.dim} parameters, more than max_dim={max_dim}; "
            "pass a larger max_dim (D HVPs) or use hutchinson_diagonal(op) instead"
        )
    start, size = 0, first or op.batch_size
    while start < op.dim:
        n = min(size, op.batch_size, op.dim - start)
        units = torch.zeros(n, op.dim, dtype=op.dtype, device=op.device)
        idx = torch.arange(n, device=op.device)
        units[idx, start + idx] = 1
        yield start, op.matmat(units)
        start, size = start + n, 2 * size
