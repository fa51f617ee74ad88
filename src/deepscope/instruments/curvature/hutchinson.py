"""Hutchinson's stochastic estimators of the Hessian diagonal and trace."""

from __future__ import annotations

import torch

from .estimate import Estimate
from .operator import HessianOperator, check_int, check_operator, rademacher, seeded_generator


def hutchinson_diagonal(op: HessianOperator, samples: int = 10, seed: int = 0) -> Estimate:
    """Unbiased estimate of diag(H): the mean of z ⊙ Hz over Rademacher probes z.

    Element d has variance Σ_{e≠d} H_de² / samples. Probes are applied in batches of
    ``op.batch_size`` (one vmapped backward pass each).

    Returns:
        Estimate with a detached flat (D,) tensor (loss units per parameter unit squared),
        estimator "hutchinson", samples = probe vectors = HVPs used.
    """
    op = check_operator(op)
    check_int("samples", samples, 1)
    generator = seeded_generator(op, seed)
    total = torch.zeros(op.dim, dtype=op.dtype, device=op.device)
    for start in range(0, samples, op.batch_size):
        probes = rademacher(op, min(op.batch_size, samples - start), generator)
        total += op.matmat(probes).mul_(probes).sum(0)  # in place: (k, D) temporaries page-fault
    return Estimate(total.div_(samples), "hutchinson", samples)


def hutchinson_trace(op: HessianOperator, samples: int = 10, seed: int = 0) -> Estimate:
    """Unbiased estimate of tr(H): the mean of zᵀHz over Rademacher probes z.

    The sum of `hutchinson_diagonal` with the same probes; its variance is
    2(‖H‖_F² − Σ_d H_dd²) / samples.

    Returns:
        Estimate with a float value (loss units per parameter unit squared),
        estimator "hutchinson", samples = probe vectors = HVPs used.
    """
    diagonal = hutchinson_diagonal(op, samples, seed)
    return Estimate(float(diagonal.value.sum()), "hutchinson", samples)
