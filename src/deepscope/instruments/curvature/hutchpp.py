"""Hutch++ trace estimation (Meyer, Musco, Musco, Woodruff, SOSA 2021)."""

from __future__ import annotations

import torch

from .estimate import Estimate
from .operator import HessianOperator, check_int, check_operator, rademacher, seeded_generator


def hutchpp_trace(op: HessianOperator, samples: int = 30, seed: int = 0) -> Estimate:
    """Unbiased estimate of tr(H) that is exact on the dominant subspace.

    A third of the HVPs sketch the range of H (Q = orth(H S), S Rademacher), a third
    take the trace of QᵀHQ exactly, and the rest run Hutchinson on the deflated
    (I − QQᵀ) H (I − QQᵀ). With a fast-decaying spectrum the error falls like 1/samples
    instead of Hutchinson's 1/√samples; with samples >= 3D the trace is exact up to
    round-off.

    Returns:
        Estimate with a float value (loss units per parameter unit squared),
        estimator "hutch++", samples = HVPs used (``samples``, or fewer when samples/3 > D).
    """
    op = check_operator(op)
    check_int("samples", samples, 3)
    generator = seeded_generator(op, seed)
    n_sketch = samples // 3
    n_probe = samples - 2 * n_sketch

    sketch = op.matmat(rademacher(op, n_sketch, generator))
    q, _ = torch.linalg.qr(sketch.T)  # (D, r): orthonormal even if the sketch is rank-deficient
    basis = q.T  # (r, D), r = min(n_sketch, D)
    low_rank = (basis * op.matmat(basis)).sum()

    probes = rademacher(op, n_probe, generator)
    probes = probes - (probes @ q) @ basis  # project out the sketched subspace
    residual = (probes * op.matmat(probes)).sum() / n_probe
    used = n_sketch + basis.shape[0] + n_probe
    return Estimate(float(low_rank + residual), "hutch++", used)
