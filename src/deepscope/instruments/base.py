"""Values that instruments hand to the recorder for storage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

TOTAL = ""  # the `layer` of a whole-model value


@dataclass
class QuantityValue:
    """One stored value of a quantity at one step.

    name:   Cockpit name, e.g. "GradNorm", "Alpha", "GradHist1d".
    step:   the step the value belongs to (Alpha and UpdateSize: step t, computed later).
    layer:  "" for the whole model, else a parameter's dotted name (e.g. "0.weight").
    value:  the scalar, or None when missing (then `meta["reason"]` says why) or when
            the value is an array.
    array:  histogram counts or another array (float64 / int64), else None.
    meta:   JSON-serialisable extras: estimator, samples, edges, under/overflow,
            nan/posinf/neginf counts, reason for a missing value.
    """

    name: str
    step: int
    layer: str = TOTAL
    value: float | None = None
    array: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)
