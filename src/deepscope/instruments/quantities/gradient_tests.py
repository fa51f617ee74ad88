"""Cockpit's gradient tests (NormTest, InnerTest, OrthoTest) from per-sample statistics.

Each test needs, per row r (a parameter tensor, or the whole model):
    S[r]    = Σᵢ ‖gᵢ‖²          (sum of the per-sample squared norms)
    Q[r, i] = gᵢᵀḡ               (per-sample inner products with the mean gradient)
    N[r]    = ‖ḡ‖²
and the batch size B. The identities Σᵢ‖gᵢ − ḡ‖² = S − B·N and
‖gᵢ − (gᵢᵀḡ/N)ḡ‖² = ‖gᵢ‖² − (gᵢᵀḡ)²/N give the definitions in QUANTITIES.md without
per-sample gradients. Results are dimensionless; a row with N = 0 (or B < 2) is
undefined and comes out NaN or Inf. Round-off can make a variance numerator slightly
negative when all gᵢ are (nearly) equal; it is clamped to 0.
"""

from __future__ import annotations

from torch import Tensor


def _denominator(batch_size: int, grad_sq_norms: Tensor) -> Tensor:
    return batch_size * (batch_size - 1) * grad_sq_norms.double()


def norm_test(sq_norm_sums: Tensor, grad_sq_norms: Tensor, batch_size: int) -> Tensor:
    """√( Σᵢ‖gᵢ − ḡ‖² / (B(B−1)‖ḡ‖²) ) per row.

    Args:
        sq_norm_sums: (R,) S = Σᵢ ‖gᵢ‖².
        grad_sq_norms: (R,) N = ‖ḡ‖².
        batch_size: B.

    Returns:
        (R,) float64.
    """
    S, N = sq_norm_sums.double(), grad_sq_norms.double()
    return ((S - batch_size * N).clamp(min=0) / _denominator(batch_size, N)).sqrt()


def inner_test(dots_with_mean: Tensor, grad_sq_norms: Tensor, batch_size: int) -> Tensor:
    """√( Σᵢ (gᵢᵀḡ − ‖ḡ‖²)² / (B(B−1)‖ḡ‖⁴) ) per row.

    Args:
        dots_with_mean: (R, B) Q = gᵢᵀḡ.
        grad_sq_norms: (R,) N = ‖ḡ‖².
        batch_size: B.

    Returns:
        (R,) float64.
    """
    Q, N = dots_with_mean.double(), grad_sq_norms.double()
    spread = (Q - N[:, None]).square().sum(1)
    return (spread / (_denominator(batch_size, N) * N)).sqrt()


def ortho_test(
    sq_norm_sums: Tensor, dots_with_mean: Tensor, grad_sq_norms: Tensor, batch_size: int
) -> Tensor:
    """√( Σᵢ ‖gᵢ − (gᵢᵀḡ/‖ḡ‖²) ḡ‖² / (B(B−1)‖ḡ‖²) ) per row.

    Args:
        sq_norm_sums: (R,) S = Σᵢ ‖gᵢ‖².
        dots_with_mean: (R, B) Q = gᵢᵀḡ.
        grad_sq_norms: (R,) N = ‖ḡ‖².
        batch_size: B.

    Returns:
        (R,) float64.
    """
    return ortho_test_of_sums(sq_norm_sums, dots_with_mean.double().square().sum(1),
                              grad_sq_norms, batch_size)


def inner_test_of_sums(
    dot_sums: Tensor, dot_sq_sums: Tensor, grad_sq_norms: Tensor, batch_size: int
) -> Tensor:
    """`inner_test` from ΣᵢQᵢ and ΣᵢQᵢ² per row (sums over the samples of all ranks of a
    distributed run): Σᵢ (Qᵢ − N)² = ΣᵢQᵢ² − 2NΣᵢQᵢ + B·N², clamped to 0.

    Returns:
        (R,) float64.
    """
    N = grad_sq_norms.double()
    spread = (dot_sq_sums.double() - 2 * N * dot_sums.double()
              + batch_size * N.square()).clamp(min=0)
    return (spread / (_denominator(batch_size, N) * N)).sqrt()


def ortho_test_of_sums(
    sq_norm_sums: Tensor, dot_sq_sums: Tensor, grad_sq_norms: Tensor, batch_size: int
) -> Tensor:
    """`ortho_test` from S and ΣᵢQᵢ² per row (sums over the samples of all ranks).

    Returns:
        (R,) float64.
    """
    S, N = sq_norm_sums.double(), grad_sq_norms.double()
    orthogonal = (S - dot_sq_sums.double() / N).clamp(min=0)
    return (orthogonal / _denominator(batch_size, N)).sqrt()
