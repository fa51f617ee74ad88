"""Largest-magnitude Hessian eigenvalue by power iteration, as Cockpit's HessMaxEV does it."""

from __future__ import annotations

import math
import warnings

import torch

from .estimate import Estimate
from .operator import HessianOperator, check_int, check_operator, seeded_generator


def power_iteration(
    op: HessianOperator,
    max_iter: int = 100,
    rtol: float = 1e-3,
    atol: float = 1e-6,
    seed: int = 0,
) -> Estimate:
    """The Hessian eigenvalue of largest magnitude (signed), Cockpit-compatible.

    Mirrors Cockpit's ``HVPLinearOperator.power_iteration``: a uniform [0, 1) start
    vector, the Rayleigh quotient vᵀHv as the estimate, stop as soon as two consecutive
    estimates satisfy |old − new| <= atol + rtol·|new|, and warn (returning the last
    estimate) after max_iter HVPs. Power iteration converges to the eigenvalue of largest
    *magnitude*, which is negative when the most negative eigenvalue dominates; use
    `lanczos` for the largest algebraic one.

    Returns:
        Estimate with a float value (loss units per parameter unit squared),
        estimator "power_iteration", samples = HVPs used.
    """
    op = check_operator(op)
    check_int("max_iter", max_iter, 1)
    if not (rtol >= 0 and atol >= 0):
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    generator = seeded_generator(op, seed)
    v = torch.rand(op.dim, generator=generator, dtype=op.dtype, device=op.device)
    v = v / v.norm()
    eigval = math.inf
    for i in range(1, max_iter + 1):
        hv = op.matvec(v)
        new = float(torch.dot(v, hv))
        if abs(eigval - new) <= atol + rtol * abs(new):
            return Estimate(new, "power_iteration", i)
        norm = hv.norm()
        if norm == 0:  # v lies in the null space; Cockpit would divide by zero here
            return Estimate(new, "power_iteration", i)
        v = hv / norm
        eigval = new
    warnings.warn(
        f"power_iteration did not converge in max_iter={max_iter} HVPs "
        f"(rtol={rtol}, atol={atol}); returning the last estimate",
        RuntimeWarning,
        stacklevel=2,
    )
    return Estimate(eigval, "power_iteration", max_iter)
