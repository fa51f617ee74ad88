"""α's quadratic fit against the GLS normal equations written out literally, and its
special cases (QUANTITIES.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepscope.instruments.alpha import (
    AlphaFit,
    LinePoint,
    fit_alpha,
    line_point,
)


def normal_equations(start: LinePoint, end: LinePoint, tau: float) -> tuple[float, np.ndarray]:
    """μ = (ΦᵀΛ⁻¹Φ)⁻¹ΦᵀΛ⁻¹y and α, exactly as QUANTITIES.md writes them."""
    phi = np.array([[1, 0, 0], [1, tau, tau**2], [0, 1, 0], [0, 1, 2 * tau]], dtype=float)
    var = np.array([start.var_f, end.var_f, start.var_df, end.var_df], dtype=float)
    var[var == 0] = 1e-10
    lam_inv = np.diag(1 / var)
    y = np.array([start.f, end.f, start.df, end.df])
    mu = np.linalg.inv(phi.T @ lam_inv @ phi) @ phi.T @ lam_inv @ y
    alpha = -1.0 if mu[2] < 0 else 2 * tau / (-mu[1] / mu[2]) - 1
    return alpha, mu


positive = st.floats(1e-3, 10.0)


@given(
    f=st.tuples(st.floats(0.1, 5), st.floats(0.1, 5)),
    df=st.tuples(st.floats(-3, -0.05), st.floats(-3, 3)),
    var=st.tuples(positive, positive, positive, positive),
    tau=st.floats(0.01, 2.0),
)
@settings(max_examples=100, deadline=None)
def test_fit_matches_the_normal_equations(f, df, var, tau) -> None:
    start = LinePoint(f[0], var[0], df[0], var[2])
    end = LinePoint(f[1], var[1], df[1], var[3])
    want_alpha, want_mu = normal_equations(start, end, tau)
    fit = fit_alpha(start, end, tau)
    np.testing.assert_allclose(fit.mu, want_mu, rtol=1e-6, atol=1e-9 * np.abs(want_mu).max())
    assert fit.alpha == pytest.approx(want_alpha, rel=1e-6, abs=1e-9)
    assert fit.reason is None


@pytest.mark.parametrize(("tau", "alpha"), [(1.0, 0.0), (2.0, 1.0), (0.5, -0.5), (3.0, 2.0)])
def test_noise_free_parabola(tau: float, alpha: float) -> None:
    """f(s) = (s − 1)² + 0.3, measured exactly: α = τ/s* − 1 with s* = 1."""
    def point(s: float) -> LinePoint:
        return LinePoint(f=(s - 1) ** 2 + 0.3, var_f=0.01, df=2 * (s - 1), var_df=0.01)

    fit = fit_alpha(point(0.0), point(tau), tau)
    assert fit.alpha == pytest.approx(alpha, abs=1e-9)
    np.testing.assert_allclose(fit.mu, [1.3, -2.0, 1.0], atol=1e-9)


def test_concave_fit_gives_minus_one() -> None:
    start = LinePoint(1.0, 0.1, -1.0, 0.1)
    end = LinePoint(0.0, 0.1, -3.0, 0.1)  # still going down, and faster: μ₂ < 0
    fit = fit_alpha(start, end, 1.0)
    assert fit.alpha == -1.0 and fit.mu[2] < 0


def test_zero_step_gives_minus_one_without_a_fit() -> None:
    point = LinePoint(1.0, 0.1, -1.0, 0.1)
    assert fit_alpha(point, point, 0.0) == AlphaFit(alpha=-1.0, mu=None)


def test_zero_variances_are_replaced_by_1e_minus_10() -> None:
    start, end = LinePoint(1.0, 0.0, -1.0, 0.0), LinePoint(0.7, 0.2, 0.1, 0.0)
    want_alpha, want_mu = normal_equations(start, end, 0.4)
    fit = fit_alpha(start, end, 0.4)
    np.testing.assert_allclose(fit.mu, want_mu, rtol=1e-5)
    assert fit.alpha == pytest.approx(want_alpha, rel=1e-5)


def test_non_finite_inputs_give_nan_with_reason() -> None:
    good = LinePoint(1.0, 0.1, -1.0, 0.1)
    fit = fit_alpha(good, LinePoint(math.nan, 0.1, -1.0, 0.1), 0.5)
    assert math.isnan(fit.alpha) and fit.mu is None and "non-finite" in fit.reason


def test_singular_fit_is_missing_with_reason() -> None:
    # only one point carries weight: three unknowns cannot be determined
    start = LinePoint(1.0, 1e-300, -1.0, 1e300)
    end = LinePoint(0.5, 1e300, -0.5, 1e300)
    fit = fit_alpha(start, end, 1.0)
    assert fit.alpha is None and fit.reason == "the quadratic fit is singular"


def test_zero_start_slope_is_missing_with_reason() -> None:
    start = LinePoint(1.0, 0.1, 0.0, 0.1)
    end = LinePoint(2.0, 0.1, 2.0, 0.1)  # q(s) = 1 + s²: minimum at the start
    fit = fit_alpha(start, end, 1.0)
    assert fit.alpha is None and "slope" in fit.reason


def test_line_point_uses_unbiased_variances() -> None:
    losses = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float32)
    proj = torch.tensor([0.5, -0.5, 1.5], dtype=torch.float64)
    point = line_point(losses, proj)
    assert point == LinePoint(f=7 / 3, var_f=float(np.var([1, 2, 4], ddof=1)),
                              df=0.5, var_df=1.0)
    with pytest.raises(ValueError, match="at least 2 samples"):
        line_point(torch.ones(1), torch.ones(1))
