"""α, the normalised step length: a noise-aware quadratic fit along the update taken.

At step t (batch t, parameters θₜ) the start point is measured; once the optimiser has
stepped, dₜ = θₜ₊₁ − θₜ is known and the per-sample slopes gᵢᵀdₜ/‖dₜ‖ come from the
still-captured step-t statistics, so no per-sample gradient is kept across steps. At
step t + 1 the end point is measured on batch t + 1 along the same direction. The fit
and α follow QUANTITIES.md exactly; α = 0 means the step reached the valley floor,
−1 no progress, 1 the opposite side at equal height, > 1 overshooting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from .base import QuantityValue

if TYPE_CHECKING:
    from .batch import Batch

MIN_VARIANCE = 1e-10  # a zero variance would give the point infinite weight


@dataclass(frozen=True)
class LinePoint:
    """The loss and its slope along d̂ at one end of the step, with sample variances.

    f:      mean loss over the batch (loss units).
    var_f:  unbiased variance of the per-sample losses ℓᵢ.
    df:     mean over i of gᵢᵀd̂ (loss units per parameter unit).
    var_df: unbiased variance over i of gᵢᵀd̂.
    """

    f: float
    var_f: float
    df: float
    var_df: float

    def is_finite(self) -> bool:
        return all(math.isfinite(v) for v in (self.f, self.var_f, self.df, self.var_df))


@dataclass
class AlphaStart:
    """What step t leaves for its α: the start point, the update dₜ and τ = ‖dₜ‖."""

    step: int
    point: LinePoint
    update: dict[str, Tensor]  # dₜ⁽ᵏ⁾ per parameter tensor (the direction is dₜ/τ)
    tau: float


@dataclass(frozen=True)
class AlphaFit:
    """α and the fitted parabola q(s) = μ₀ + μ₁s + μ₂s² on s ∈ [0, τ].

    alpha is None when undefined (then `reason` says why); mu is None when no fit was made.
    """

    alpha: float | None
    mu: tuple[float, float, float] | None
    reason: str | None = None


def line_point(losses: Tensor, projections: Tensor) -> LinePoint:
    """The LinePoint of a batch from its per-sample losses and projected gradients.

    Args:
        losses: (B,) ℓᵢ.
        projections: (B,) gᵢᵀd̂ with d̂ the unit update direction.

    Raises:
        ValueError: if B < 2 (no sample variance).
    """
    if losses.numel() < 2:
        raise ValueError("α needs a batch of at least 2 samples for the loss variance")
    stacked = torch.stack([losses.reshape(-1).double(), projections.reshape(-1).double()])
    var, mean = torch.var_mean(stacked, dim=1, correction=1)
    (f, df), (var_f, var_df) = mean.tolist(), var.tolist()
    return LinePoint(f=f, var_f=var_f, df=df, var_df=var_df)


def line_point_of_moments(count: float, loss: Tensor, slope: Tensor) -> LinePoint:
    """The LinePoint of a batch from `count` samples' moments: loss and slope are each
    (mean, M2), M2 = Σᵢ (xᵢ − mean)² (e.g. merged over the ranks of a distributed run).

    Raises:
        ValueError: if count < 2 (no sample variance).
    """
    if count < 2:
        raise ValueError("α needs a batch of at least 2 samples for the loss variance")
    (f, m2_f), (df, m2_df) = loss.tolist(), slope.tolist()
    return LinePoint(f=f, var_f=m2_f / (count - 1), df=df, var_df=m2_df / (count - 1))


def fit_alpha(start: LinePoint, end: LinePoint, tau: float) -> AlphaFit:
    """Generalised least-squares parabola through both points, and α.

    Φ = [[1,0,0],[1,τ,τ²],[0,1,0],[0,1,2τ]], Λ = diag(var_f₀, var_f₁, var_df₀, var_df₁)
    with zero variances replaced by 1e-10, μ = (ΦᵀΛ⁻¹Φ)⁻¹ΦᵀΛ⁻¹[f₀, f₁, df₀, df₁];
    α = 2τ/(−μ₁/μ₂) − 1, α = −1 if μ₂ < 0 or τ = 0. Non-finite inputs give α = NaN.

    The solve runs on s = τu (u ∈ [0, 1]) with rows weighted by 1/σ, by least squares:
    the same μ as the normal equations, without squaring their condition number.
    """
    if tau == 0:
        return AlphaFit(alpha=-1.0, mu=None, reason=None)
    if not (start.is_finite() and end.is_finite() and math.isfinite(tau)):
        return AlphaFit(alpha=math.nan, mu=None, reason="non-finite loss, slope or step")
    variances = np.array([start.var_f, end.var_f, start.var_df, end.var_df], dtype=np.float64)
    variances[variances == 0] = MIN_VARIANCE
    # in u = s/τ the slope rows become τ·df, with variance τ²·var_df
    values = np.array([start.f, end.f, tau * start.df, tau * end.df], dtype=np.float64)
    variances[2:] *= tau * tau
    design = np.array([[1, 0, 0], [1, 1, 1], [0, 1, 0], [0, 1, 2]], dtype=np.float64)
    weights = 1 / np.sqrt(variances)
    coef, _, rank, _ = np.linalg.lstsq(design * weights[:, None], values * weights, rcond=None)
    if rank < 3:
        return AlphaFit(alpha=None, mu=None, reason="the quadratic fit is singular")
    c0, c1, c2 = (float(c) for c in coef)
    mu = (c0, c1 / tau, c2 / (tau * tau))
    if c2 < 0:
        return AlphaFit(alpha=-1.0, mu=mu)
    if abs(c1) <= 64 * np.finfo(np.float64).eps * c2:  # zero up to round-off: α = ±huge
        return AlphaFit(alpha=None, mu=mu, reason="the fitted slope at the start is zero")
    # 2τ/(−μ₁/μ₂) − 1 = −2τμ₂/μ₁ − 1 = −2c₂/c₁ − 1
    return AlphaFit(alpha=-2 * c2 / c1 - 1, mu=mu)


# -- the two steps of one α, as the suite drives them --------------------------------------
def want_dots(
    batch: Batch, end: AlphaStart | None, update: dict[str, Tensor] | None, tau: float
) -> None:
    """Register α's products gᵢ·v of this step with the others, to share one pass: along
    the previous step's update `end` (its end point) and along this step's `update` of
    size τ (its start point, unless τ = 0 or it is a plain SGD step)."""
    if end is not None:
        batch.want("end", end.update)
    if update is not None and tau > 0 and not batch.is_sgd_step("start", update, tau):
        batch.want("start", update)


def measure_start(
    step: int, losses: Tensor, batch: Batch, update: dict[str, Tensor], tau: float
) -> AlphaStart | QuantityValue:
    """α's start point at `step` (α itself comes at the next step), or α = −1 now if the
    update dₜ (`update`, per parameter tensor; τ = ‖dₜ‖) is zero.

    Args:
        losses: (B,) ℓᵢ of the step's batch.
    """
    if tau == 0:
        return QuantityValue("Alpha", step, value=-1.0, meta={"tau": 0.0})
    projections = batch.projections("start", update, tau)
    batch.check_complete("Alpha")
    return AlphaStart(step, line_point(losses, projections), update, tau)


def measure_alpha(start: AlphaStart, losses: Tensor, batch: Batch, end_step: int) -> QuantityValue:
    """α of step start.step from its start point and the end point measured at `end_step`
    on its batch (`losses`: (B,) ℓᵢ)."""
    projections = batch.projections("end", start.update, start.tau)
    batch.check_complete("Alpha")
    return alpha_value(start, line_point(losses, projections), end_step)


def alpha_value(start: AlphaStart, end: LinePoint, end_step: int) -> QuantityValue:
    """α of step start.step from its start point and the end point `end` measured at
    `end_step` along the same direction."""
    fit = fit_alpha(start.point, end, start.tau)
    meta: dict[str, Any] = {
        "tau": start.tau, "end_step": end_step,
        "f": [start.point.f, end.f], "df": [start.point.df, end.df],
        "var_f": [start.point.var_f, end.var_f], "var_df": [start.point.var_df, end.var_df],
    }
    if fit.mu is not None:
        meta["mu"] = list(fit.mu)
    if fit.reason is not None:
        meta["reason"] = fit.reason
    return QuantityValue("Alpha", start.step, value=fit.alpha, meta=meta)
