"""What each quantity needs at a step, and the curvature modes; the names and
configurations live in the catalogue (`deepscope.catalogue`, torch-free) and are re-exported
here.
"""

from __future__ import annotations

from ..catalogue import (
    BUSINESS,
    CONFIGURATIONS,
    ECONOMY,
    FULL,
    QUANTITY_NAMES,
    needing,
    resolve_quantities,
)

__all__ = ["BUSINESS", "CONFIGURATIONS", "ECONOMY", "FULL", "QUANTITY_NAMES",
           "resolve_quantities"]

# What each quantity needs at a step, so the suite turns on only that (derived from the
# catalogue's built-in specs; the suite asks `catalogue.needing` so registered ones count).
NEEDS_ENGINE: frozenset[str] = needing("engine")
NEEDS_DIAGONAL: frozenset[str] = needing("diagonal")
NEEDS_HESSIAN: frozenset[str] = needing("hessian")
# per_sample= is needed to infer the loss reduction (mean or sum), which fixes the
# per-sample gradients and the Hessian of the mean loss, and for α's loss variance.
NEEDS_PER_SAMPLE: frozenset[str] = NEEDS_ENGINE | NEEDS_HESSIAN
# θₜ must be copied at the start of the step (update dₜ, θₜ for the 2-D histogram).
NEEDS_SNAPSHOT: frozenset[str] = needing("snapshot")

CURVATURE_MODES: tuple[str, ...] = ("auto", "exact", "hutchinson")


def check_curvature_mode(mode: str) -> str:
    """Return `mode` if it is a valid Hessian-diagonal mode, else raise a one-line error.

    "auto": the exact diagonal (D HVPs) when its measured cost fits a budget of a few
    training steps, else Hutchinson (`curvature.choose_diagonal`); "exact": always exact
    (D HVPs, however large the model); "hutchinson": always Hutchinson.
    """
    if not isinstance(mode, str) or mode not in CURVATURE_MODES:
        raise ValueError(f"curvature must be one of {', '.join(CURVATURE_MODES)}, got {mode!r}")
    return mode
