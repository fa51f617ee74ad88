"""Signal-to-noise quantities: MeanGSNR, EarlyStopping, CABS.

Notation (QUANTITIES.md): ḡₐ the mean gradient element, Mₐ = (1/B) Σᵢ gᵢ,ₐ² the
uncentred second moment, B the batch size. Per-element variances computed from these
can come out slightly negative by round-off; they are clamped to 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .norms import with_total

GSNR_EPS = 1e-5
EARLY_STOPPING_EPS = 1e-5


def _layer_means(terms: Sequence[Tensor]) -> Tensor:
    """Mean of each layer's elementwise terms, then the mean over all elements; (K + 1,)."""
    sums = torch.stack([t.sum() for t in terms])
    counts = torch.tensor([t.numel() for t in terms], dtype=torch.float64, device=sums.device)
    return with_total(sums) / with_total(counts)


def mean_gsnr(
    grad_mean: Sequence[Tensor],
    second_moment_sums: Sequence[Tensor],
    batch_size: int,
    eps: float = GSNR_EPS,
) -> Tensor:
    """meanₐ [ ḡₐ² / (Mₐ − ḡₐ² + ε) ] per parameter tensor and over all elements.

    Args:
        grad_mean: ḡ⁽ᵏ⁾ per parameter tensor (any shape).
        second_moment_sums: Σᵢ (gᵢ⁽ᵏ⁾)² elementwise, same shapes (not divided by B).
        batch_size: B.
        eps: ε, in squared-gradient units (Cockpit: 1e-5).

    Returns:
        (K + 1,) float64, dimensionless.
    """
    terms = []
    for g, m2 in zip(grad_mean, second_moment_sums):
        g2 = g.double().square()
        variance = (m2.double() / batch_size - g2).clamp(min=0)
        terms.append(g2 / (variance + eps))
    return _layer_means(terms)


def early_stopping(
    grad_mean: Sequence[Tensor],
    second_moment_sums: Sequence[Tensor],
    batch_size: int,
    eps: float = EARLY_STOPPING_EPS,
) -> Tensor:
    """1 − B · meanₐ [ ḡₐ² / (σ̂ₐ² + ε) ], σ̂ₐ² = Σᵢ (gᵢ,ₐ − ḡₐ)² / (B − 1).

    Args as `mean_gsnr`. B < 2 makes σ̂² undefined (division by zero).

    Returns:
        (K + 1,) float64, dimensionless; positive suggests stopping (Mahsereci et al.).
    """
    terms = []
    for g, m2 in zip(grad_mean, second_moment_sums):
        g2 = g.double().square()
        variance = ((m2.double() - batch_size * g2) / (batch_size - 1)).clamp(min=0)
        terms.append(g2 / (variance + eps))
    return 1 - batch_size * _layer_means(terms)


def cabs(
    sq_norm_sums: Tensor, grad_sq_norms: Tensor, batch_size: int, loss: float, lr: float
) -> Tensor:
    """lr · Σₐ Σᵢ (gᵢ,ₐ − ḡₐ)² / (B · L) per row (CABS' suggested batch size).

    Uses Σₐ Σᵢ (gᵢ,ₐ − ḡₐ)² = Σᵢ ‖gᵢ‖² − B‖ḡ‖² over the row's elements.

    Args:
        sq_norm_sums: (R,) Σᵢ ‖gᵢ‖².
        grad_sq_norms: (R,) ‖ḡ‖².
        batch_size: B.
        loss: L, the mean loss of the batch (a zero loss makes CABS undefined).
        lr: the learning rate.

    Returns:
        (R,) float64, in samples (a batch size).
    """
    spread = (sq_norm_sums.double() - batch_size * grad_sq_norms.double()).clamp(min=0)
    return lr * spread / (batch_size * loss)
