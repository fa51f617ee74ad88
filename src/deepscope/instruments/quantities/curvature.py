"""Curvature quantities (HessTrace, HessMaxEV, TICDiag, TICTrace) on the curvature package.

H is the Hessian of the mean loss L; the caller builds the `HessianOperator` on L (not on
a summed loss). Values are in loss units per parameter unit squared (TIC: dimensionless
ratios of second moments to curvature).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...scratch import scratch
from ..curvature import (
    Estimate,
    HessianOperator,
    exact_diagonal,
    hutchinson_diagonal,
    layer_traces,
)
from ..curvature.lanczos import LinearOperator, lanczos_iterations
from ..curvature.operator import seeded_generator
from .norms import with_total

EXACT_MAX_DIM = 5000  # "auto" takes the exact diagonal (D HVPs) up to this many parameters
# Instruments' "auto" takes the exact diagonal only when its D HVPs cost at most this many
# training steps, or at most AUTO_FLOOR_S seconds (a tiny model's step is too short to time).
AUTO_STEP_FACTOR = 10
AUTO_FLOOR_S = 0.1
FORWARD_SHARE = 3  # a training step (forward, backward at ~2 forwards) ≈ 3 forwards
TIC_EPS = 1e-7
MAX_EV_TOL = 1e-4  # HessMaxEV's Lanczos stops once its value moves by <= 1e-4 relatively
TIC_CHUNK = 1 << 20  # elements per pass of tic_diag: its two float64 buffers stay at 16 MiB


def hessian_diagonal(
    op: HessianOperator, mode: str, samples: int, seed: int, exact_max_dim: int = EXACT_MAX_DIM
) -> Estimate:
    """diag(H), flat (D,), exactly or by Hutchinson's estimator.

    Args:
        op: the Hessian operator of the mean loss.
        mode: "exact" (D HVPs), "hutchinson" (`samples` HVPs), or "auto" (exact when
            D <= exact_max_dim, else Hutchinson).
        samples: Rademacher probes for Hutchinson.
        seed: probe seed.

    Returns:
        Estimate whose value is a detached (D,) tensor; estimator and samples say how.
    """
    if mode == "exact" or (mode == "auto" and op.dim <= exact_max_dim):
        return exact_diagonal(op, max_dim=op.dim)
    return hutchinson_diagonal(op, samples=samples, seed=seed)


def diagonal_budget(forward_s: float) -> float:
    """Seconds "auto" lets the exact diagonal take at a step whose forward took forward_s:
    AUTO_STEP_FACTOR training steps (each ≈ FORWARD_SHARE forwards), at least AUTO_FLOOR_S."""
    return max(AUTO_STEP_FACTOR * FORWARD_SHARE * forward_s, AUTO_FLOOR_S)


def choose_diagonal(
    dim: int, samples: int, hvp_s: float, forward_s: float, exact_max_dim: int = EXACT_MAX_DIM,
    one_pass: int = 1,
) -> tuple[str, str]:
    """The estimator "auto" takes for diag(H), by cost, and why (one line).

    The exact diagonal costs `dim` HVPs, Hutchinson's `samples`. Exact is taken, by count,
    when its HVPs fit in as few batched backward passes as Hutchinson's (dim <=
    max(samples, one_pass)); else, by time, when dim <= exact_max_dim and its projected
    time, dim · hvp_s, is within `diagonal_budget(forward_s)` (the caller also stops it
    when it overruns that budget: see `over_budget`).

    Args:
        dim: D, the number of parameter elements.
        samples: Hutchinson's probes (HVPs) per step.
        hvp_s: measured seconds of one HVP (unused, may be NaN, when decided by count).
        forward_s: measured seconds of the user's forward pass at this step.
        one_pass: HVPs per batched backward pass (`HessianOperator.batch_size`).
    Returns:
        ("exact" | "hutchinson", why).
    """
    if dim <= max(samples, one_pass):
        return "exact", (f"curvature='auto' chose the exact Hessian diagonal: its D={dim} HVPs "
                         f"take one batched backward pass, as Hutchinson's {samples} do")
    cost = f"D={dim} HVPs, about {_seconds(dim * hvp_s)} per step ({_seconds(hvp_s)} each)"
    if dim > exact_max_dim:
        return "hutchinson", (f"{_hutchinson(samples)}: the exact one needs D={dim} HVPs, more "
                              f"than {exact_max_dim}")
    if dim * hvp_s <= diagonal_budget(forward_s):
        return "exact", f"curvature='auto' chose the exact Hessian diagonal: {cost}, within " \
                        f"{_limit(forward_s)}"
    return "hutchinson", f"{_hutchinson(samples)}: the exact one needs {cost}, more than " \
                         f"{_limit(forward_s)}"


def over_budget(dim: int, step: int, samples: int, projected_s: float, forward_s: float) -> str:
    """Why "auto" left the exact diagonal at `step`: it overran `diagonal_budget`."""
    return (f"{_hutchinson(samples)} from step {step} on: the exact one (D={dim} HVPs) would "
            f"have taken about {_seconds(projected_s)}, more than {_limit(forward_s)}")


def _hutchinson(samples: int) -> str:
    return (f"curvature='auto' chose Hutchinson's estimator ({samples} HVPs per step) for the "
            "Hessian diagonal")


def _limit(forward_s: float) -> str:
    return (f"{AUTO_STEP_FACTOR}× a training step (about {_seconds(FORWARD_SHARE * forward_s)})"
            f" or {_seconds(AUTO_FLOOR_S)}")


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def hess_trace(op: HessianOperator, diagonal: Tensor) -> Tensor:
    """Σₐ Hₐₐ per parameter tensor, then in total; float64 (K + 1,) on the diagonal's device."""
    traces = torch.tensor(layer_traces(op, diagonal), dtype=torch.float64)
    return with_total(traces.to(diagonal.device))


def hess_max_ev(op: HessianOperator | LinearOperator, num_iter: int,
                seed: int) -> tuple[float, dict[str, Any]]:
    """The largest algebraic eigenvalue of H by Lanczos, and meta for storage: a cold
    start and all min(num_iter, D) iterations (`top_eigenvalue` with tol=0).

    op: the Hessian operator, or any symmetric operator Lanczos takes (`GlobalHessian`).

    Returns:
        (value, meta) as `top_eigenvalue`.
    """
    value, meta, _ = top_eigenvalue(op, num_iter, seed, tol=0.0)
    return value, meta


def top_eigenvalue(op: HessianOperator | LinearOperator, num_iter: int, seed: int,
                   start: Tensor | None = None, tol: float = MAX_EV_TOL,
                   ) -> tuple[float, dict[str, Any], Tensor | None]:
    """HessMaxEV: the largest algebraic eigenvalue of H by Lanczos, warm-started and
    stopped once converged; meta for storage; the top Ritz vector for the next step.

    Args:
        num_iter: the most Lanczos iterations (HVPs).
        seed: the random start's seed (mixed with `start`, see `lanczos_iterations`).
        start: the previous step's top Ritz vector (D,), or None.
        tol: Lanczos stops once the value changed by at most tol relatively over the
            last iteration, with a residual of at most √tol · |value| (see
            `lanczos_iterations`); 0: never early (converged only on a full basis).

    Returns:
        (value, meta, vector): meta {"max_magnitude", "min_algebraic", "estimator",
        "samples" (HVPs spent = iterations), "converged", "warm_start", "residual"
        (‖H y − θ y‖: an eigenvalue of H lies within it of the value)}, plus "note" when
        Lanczos did not converge within num_iter (the value is then a lower bound of the
        largest eigenvalue, maybe a loose one). min_algebraic and max_magnitude are Ritz
        values of the same iterations, not converged by this test.
    """
    run = lanczos_iterations(op, num_iter, seeded_generator(op, seed), start, tol)
    top = run.estimates["max_algebraic"]
    meta: dict[str, Any] = {
        "max_magnitude": run.estimates["max_magnitude"].value,
        "min_algebraic": run.estimates["min_algebraic"].value,
        "estimator": top.estimator,
        "samples": top.samples,
        "converged": run.converged,
        "warm_start": start is not None,
        "residual": run.residual if run.vector is not None else None,  # None: a NaN product
    }
    if tol > 0 and not run.converged and run.vector is not None:
        meta["note"] = (f"Lanczos did not converge within lanczos_iter={num_iter} iterations "
                        f"(relative change over the last one > {tol:g}, or residual "
                        f"{run.residual:.3g} > {math.sqrt(tol):.3g} × |value|): the value is a "
                        "lower bound of the largest eigenvalue; raise lanczos_iter")
    return float(top.value), meta, run.vector


def tic_diag(
    second_moments: Sequence[Tensor], diagonals: Sequence[Tensor], eps: float = TIC_EPS
) -> Tensor:
    """Σₐ Mₐ / (Hₐₐ + ε) per parameter tensor, then in total; float64 (K + 1,).

    Args:
        second_moments: Mₐ = (1/B) Σᵢ gᵢ,ₐ² per parameter tensor.
        diagonals: the matching segments of diag(H) (same element counts).
        eps: ε (Cockpit: 1e-7).
    """
    terms = []
    for m, h in zip(second_moments, diagonals):
        m, h = m.reshape(-1), h.to(m.device).reshape(-1)
        # float64 operands (exact casts; mixed dtypes divide far slower) in reused buffers
        # of at most TIC_CHUNK elements: fresh large temporaries page-fault on the CPU
        term = torch.zeros((), dtype=torch.float64, device=m.device)
        for lo in range(0, m.numel(), TIC_CHUNK):
            mc, hc = m[lo:lo + TIC_CHUNK], h[lo:lo + TIC_CHUNK]
            shape = (mc.numel(),)
            denominator = scratch(shape, torch.float64, "tic-h", m.device).copy_(hc).add_(eps)
            term += scratch(shape, torch.float64, "tic-m", m.device).copy_(mc).div_(
                denominator).sum()
        terms.append(term)
    return with_total(torch.stack(terms))


def tic_trace(second_moments: Sequence[Tensor], traces: Tensor, eps: float = TIC_EPS) -> Tensor:
    """Σₐ Mₐ / (Σₐ Hₐₐ + ε) per parameter tensor, then in total; float64 (K + 1,).

    Args:
        second_moments: Mₐ per parameter tensor.
        traces: (K + 1,) Hessian traces per tensor and in total (as `hess_trace` returns).
        eps: ε (Cockpit: 1e-7).
    """
    sums = torch.stack([m.double().sum() for m in second_moments])
    return with_total(sums) / (traces.to(sums.device) + eps)
