"""Extreme Hessian eigenvalues by the Lanczos method with full reorthogonalisation."""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from .estimate import Estimate
from .operator import HessianOperator, check_int, check_operator, seeded_generator


class LinearOperator(Protocol):
    """What Lanczos needs of an operator on flat (D,) vectors."""

    dim: int
    dtype: torch.dtype
    device: torch.device

    def matvec(self, v: Tensor, out: Tensor | None = None) -> Tensor: ...


def lanczos(op: HessianOperator, num_iter: int = 30, seed: int = 0) -> dict[str, Estimate]:
    """Largest and smallest algebraic, and largest-magnitude, Hessian eigenvalue.

    Runs ``min(num_iter, D)`` Lanczos steps (one HVP each) from a seeded Gaussian start
    vector and returns the extreme Ritz values of the tridiagonal matrix. Every Lanczos
    vector is kept, shape (num_iter, D), so each new one can be orthogonalised against
    all before it (classical Gram-Schmidt, repeated when needed); hence with num_iter >= D
    the result is the exact spectrum's extremes up to round-off. Ritz values always lie
    inside the spectrum: "max_algebraic" never overestimates the largest eigenvalue.

    Returns:
        {"max_algebraic", "min_algebraic", "max_magnitude"} -> Estimate with a float value
        (signed; max_magnitude is the Ritz value of largest absolute value) in loss units
        per parameter unit squared, estimator "lanczos", samples = HVPs used.
    """
    op = check_operator(op)
    return lanczos_iterations(op, num_iter, seeded_generator(op, seed))


def lanczos_iterations(op: LinearOperator, num_iter: int,
                       generator: torch.Generator) -> dict[str, Estimate]:
    """`lanczos` on any symmetric linear operator with `dim`, `dtype`, `device` and
    `matvec(v, out=)` (e.g. the global Hessian of a distributed run); the start vector and
    any restart come from `generator`. The iterations depend only on the products'
    values, so operators that return identical products on several processes run
    identical iterations there."""
    steps = min(check_int("num_iter", num_iter, 1), op.dim)
    basis = torch.zeros(steps, op.dim, dtype=op.dtype, device=op.device)
    alphas: list[float] = []
    betas: list[float] = []
    eps = torch.finfo(op.dtype).eps
    scale = 0.0  # running estimate of ‖H‖, the yardstick for an invariant subspace
    basis[0] = _random_unit(op, generator, basis[:0])
    w = torch.empty(op.dim, dtype=op.dtype, device=op.device)  # reused: no (D,) allocations
    for j in range(steps):
        q = basis[j]
        op.matvec(q, out=w)
        alphas.append(float(torch.dot(q, w)))
        if not math.isfinite(alphas[-1]):  # a NaN/Inf in H: report NaN, never hide it
            return _result([math.nan], j + 1)
        if j == steps - 1:
            break
        # The three-term recurrence first, then full reorthogonalisation removes only
        # round-off: one pass of it suffices (see `_orthogonalise`).
        w.sub_(q, alpha=alphas[-1])
        if betas:
            w.sub_(basis[j - 1], alpha=betas[-1])
        beta = _orthogonalise(w, basis[: j + 1])
        scale = max(scale, abs(alphas[-1]) + beta)
        if beta > eps * scale:
            torch.div(w, beta, out=basis[j + 1])
        else:
            # The Krylov space is invariant (e.g. repeated eigenvalues): continue from a
            # fresh direction, decoupled in T, so that num_iter = D finds every eigenvalue.
            beta = 0.0
            basis[j + 1] = _random_unit(op, generator, basis[: j + 1])
        betas.append(beta)

    tridiagonal = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas, dtype=torch.float64)
        tridiagonal += torch.diag(off, 1) + torch.diag(off, -1)
    return _result(torch.linalg.eigvalsh(tridiagonal).tolist(), steps)


def _result(ritz: list[float], samples: int) -> dict[str, Estimate]:
    """The three extreme-eigenvalue estimates from ascending Ritz values."""
    return {
        "max_algebraic": Estimate(ritz[-1], "lanczos", samples),
        "min_algebraic": Estimate(ritz[0], "lanczos", samples),
        "max_magnitude": Estimate(max(ritz, key=abs), "lanczos", samples),
    }


def _orthogonalise(w: Tensor, basis: Tensor) -> float:
    """Remove from w (D,), in place, its components along the orthonormal rows of basis
    (j, D); returns ‖w‖ afterwards.

    Classical Gram-Schmidt, repeated only when a pass removed most of w (the DGKS criterion:
    the norm fell below 1/√2 of what it was). Only then can round-off leave components along
    the basis; otherwise one pass is orthogonal to working precision. Each pass reads the
    whole basis twice, which dominates Lanczos after the HVPs.
    """
    norm = float(w.norm())
    for _ in range(2):  # "twice is enough" (Kahan-Parlett)
        if not len(basis):
            break
        w.addmv_(basis.T, basis @ w, alpha=-1)  # in place: a fresh (D,) tensor page-faults
        before, norm = norm, float(w.norm())
        if norm >= before / math.sqrt(2):
            break
    return norm


def _random_unit(op: LinearOperator, generator: torch.Generator, basis: Tensor) -> Tensor:
    """A seeded Gaussian unit vector (D,) orthogonal to the rows of basis."""
    v = torch.randn(op.dim, generator=generator, dtype=op.dtype, device=op.device)
    return v / _orthogonalise(v, basis)
