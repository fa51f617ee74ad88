"""Curvature: a matrix-free Hessian operator, and estimators that only use its HVPs.

Example (after the forward pass, before the user's ``loss.backward()``)::

    with HessianOperator(loss, [p for p in model.parameters() if p.requires_grad]) as op:
        top = lanczos(op)["max_algebraic"].value
        trace = hutchpp_trace(op).value
    loss.backward()  # the user's graph is intact; the double-backward graph is freed
"""

from .estimate import Estimate, layer_traces
from .exact import OverBudget, dense_hessian, exact_diagonal
from .hutchinson import hutchinson_diagonal, hutchinson_trace
from .hutchpp import hutchpp_trace
from .lanczos import lanczos
from .operator import HessianOperator
from .power_iteration import power_iteration

__all__ = [
    "Estimate",
    "HessianOperator",
    "OverBudget",
    "dense_hessian",
    "exact_diagonal",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "hutchpp_trace",
    "lanczos",
    "layer_traces",
    "power_iteration",
]
