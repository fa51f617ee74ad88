"""Extreme Hessian eigenvalues by the Lanczos method with full reorthogonalisation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ...scratch import scratch
from .estimate import Estimate
from .operator import HessianOperator, check_int, check_operator, seeded_generator

# Lanczos vectors kept in a reused buffer up to this many elements (128 MiB in float32);
# the buffer stays allocated between calls, so bigger bases are allocated per call
REUSED_BASIS_ELEMENTS = 2**25


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
    return lanczos_iterations(op, num_iter, seeded_generator(op, seed)).estimates


@dataclass
class LanczosRun:
    """What `lanczos_iterations` found.

    Attributes:
        estimates: {"max_algebraic", "min_algebraic", "max_magnitude"} -> Estimate (as
            `lanczos` returns; samples = HVPs used = iterations).
        vector: the top Ritz vector (D,), unit norm, in the operator's dtype and device
            (a warm start for the next call on a nearby operator); None after a NaN.
        iterations: Lanczos steps taken (HVPs).
        residual: ‖H y − θ y‖ of the top Ritz pair (θ, y): some eigenvalue of H lies
            within it of θ (NaN after a NaN product).
        converged: whether the test of `tol` passed (with tol 0: only on a full basis).
    """

    estimates: dict[str, Estimate]
    vector: Tensor | None
    iterations: int
    residual: float
    converged: bool


def lanczos_iterations(op: LinearOperator, num_iter: int, generator: torch.Generator,
                       start: Tensor | None = None, tol: float = 0.0) -> LanczosRun:
    """`lanczos` on any symmetric linear operator with `dim`, `dtype`, `device` and
    `matvec(v, out=)` (e.g. the global Hessian of a distributed run); the start vector and
    any restart come from `generator`. The iterations depend only on the products'
    values, so operators that return identical products on several processes run
    identical iterations there (and stop at the same one: the test below reads only T).

    Args:
        start: a warm start (D,), e.g. the previous step's top Ritz vector. It is mixed
            in equal parts (as unit vectors) with the seeded Gaussian start, so the start
            keeps a random vector's share of every eigendirection and never lies in a
            deficient subspace, whatever `start` is.
        tol: stop early once the top Ritz value θ changed by at most tol · |θ| over the
            last iteration and the top Ritz pair's residual ‖H y − θ y‖ = β_j |s_j| (read
            off the tridiagonal T) is at most √tol · |θ| (which keeps a plateau of θ in a
            dense spectrum from passing for convergence: some eigenvalue of H lies within
            the residual of θ). 0: run all min(num_iter, D) steps.
    """
    steps = min(check_int("num_iter", num_iter, 1), op.dim)
    basis = _buffer((steps, op.dim), op, "lanczos-basis")
    alphas: list[float] = []
    betas: list[float] = []
    eps = torch.finfo(op.dtype).eps
    scale = 0.0  # running estimate of ‖H‖, the yardstick for an invariant subspace
    basis[0] = _random_unit(op, generator, basis[:0])
    if start is not None and start.shape == (op.dim,) and bool(start.isfinite().all()):
        warm = start.to(dtype=op.dtype, device=op.device)
        norm = float(warm.norm())
        if norm > 0:
            basis[0].add_(warm, alpha=1 / norm)
            basis[0].div_(basis[0].norm())
    w = _buffer((op.dim,), op, "lanczos-w")  # one for all iterations
    ritz, vectors, residual = [math.nan], None, math.nan
    for j in range(steps):
        q = basis[j]
        op.matvec(q, out=w)
        alphas.append(float(torch.dot(q, w)))
        if not math.isfinite(alphas[-1]):  # a NaN/Inf in H: report NaN, never hide it
            return LanczosRun(_result([math.nan], j + 1), None, j + 1, math.nan, False)
        # The three-term recurrence first, then full reorthogonalisation removes only
        # round-off: one pass of it suffices (see `_orthogonalise`). β also gives the top
        # Ritz pair's residual, so the last step runs it too (no HVP).
        w.sub_(q, alpha=alphas[-1])
        if betas:
            w.sub_(basis[j - 1], alpha=betas[-1])
        beta = _orthogonalise(w, basis[: j + 1])
        previous = ritz[-1]
        ritz, vectors = _ritz(alphas, betas)
        residual = beta * abs(float(vectors[-1, -1]))
        converged = _converged(ritz[-1], previous, residual, tol)
        if j == steps - 1 or converged:
            break
        scale = max(scale, abs(alphas[-1]) + beta)
        if beta > eps * scale:
            torch.div(w, beta, out=basis[j + 1])
        else:
            # The Krylov space is invariant (e.g. repeated eigenvalues): continue from a
            # fresh direction, decoupled in T, so that num_iter = D finds every eigenvalue.
            beta = 0.0
            basis[j + 1] = _random_unit(op, generator, basis[: j + 1])
        betas.append(beta)
    used = len(alphas)
    if used == op.dim:  # a full basis: T is similar to H, whatever round-off says of w
        residual, converged = 0.0, True
    top = basis[:used].T @ vectors[:, -1].to(op.dtype).to(op.device)
    return LanczosRun(_result(ritz, used), top, used, residual, converged)


def _buffer(shape: tuple[int, ...], op: LinearOperator, slot: str) -> Tensor:
    """An uninitialised work tensor in the operator's dtype and device (every element is
    written before it is read). Up to REUSED_BASIS_ELEMENTS it is this thread's reused
    buffer `slot`: a fresh one page-faults as it is first written, and on the CPU the
    basis alone (D = 1.06 M, 10 rows) cost 1.5 plain training steps of GPT-2 per call."""
    if math.prod(shape) <= REUSED_BASIS_ELEMENTS:
        return scratch(shape, op.dtype, slot, op.device)
    return torch.empty(shape, dtype=op.dtype, device=op.device)


def _converged(top: float, previous: float, residual: float, tol: float) -> bool:
    """`lanczos_iterations`' stopping test (see its `tol`): read only from T's values."""
    scale = abs(top)
    return tol > 0 and abs(top - previous) <= tol * scale and residual <= math.sqrt(tol) * scale


def _ritz(alphas: list[float], betas: list[float]) -> tuple[list[float], Tensor]:
    """Ascending eigenvalues of the tridiagonal T (float64) and its eigenvectors (columns)."""
    tridiagonal = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas, dtype=torch.float64)
        tridiagonal += torch.diag(off, 1) + torch.diag(off, -1)
    values, vectors = torch.linalg.eigh(tridiagonal)
    return values.tolist(), vectors


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
