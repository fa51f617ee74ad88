"""Pure functions that turn per-sample gradient statistics into Cockpit's quantities.

Conventions shared by every function here:
- Per-layer inputs come as sequences or stacked tensors with one entry per parameter
  tensor k (K of them); results are float64 tensors of shape (K + 1,) on the inputs'
  device: one value per parameter tensor, then the whole-model value LAST.
- Reductions run in float64, because several quantities subtract nearly equal numbers.
- A row whose quantity is undefined by its definition (e.g. a zero mean gradient in a
  denominator) holds NaN or ±Inf; the caller reports it as missing with the reason.

`curvature_runner` (not re-exported here) is the stateful side of `curvature`: it runs the
curvature quantities' Hessian-vector products at a step for the suite.
"""

from .curvature import (
    EXACT_MAX_DIM,
    choose_diagonal,
    diagonal_budget,
    hess_max_ev,
    hess_trace,
    hessian_diagonal,
    over_budget,
    tic_diag,
    tic_trace,
)
from .gradient_tests import (
    inner_test,
    inner_test_of_sums,
    norm_test,
    ortho_test,
    ortho_test_of_sums,
)
from .norms import layer_norms, with_total
from .snr import cabs, early_stopping, mean_gsnr

__all__ = [
    "EXACT_MAX_DIM",
    "cabs",
    "choose_diagonal",
    "diagonal_budget",
    "early_stopping",
    "hess_max_ev",
    "hess_trace",
    "hessian_diagonal",
    "inner_test",
    "inner_test_of_sums",
    "layer_norms",
    "mean_gsnr",
    "norm_test",
    "ortho_test",
    "ortho_test_of_sums",
    "over_budget",
    "tic_diag",
    "tic_trace",
    "with_total",
]
