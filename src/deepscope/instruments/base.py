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


@dataclass(frozen=True)
class InstrumentWarning:
    """Something about a run's recording the user may want to change, stored once per run.

    step:       the step at which it first occurred (None: outside any step).
    location:   what it is about: a module label ("BatchNorm1d 'bn'"), a parameter
                ("parameter 'head.weight'"), or "" for the whole model.
    quantities: the instrument quantities whose values it affects.
    message:    one line: what happened and what to do.
    """

    step: int | None
    location: str
    quantities: tuple[str, ...]
    message: str

    def text(self) -> str:
        """The one-line form shown to the user: location and message."""
        return f"{self.location}: {self.message}" if self.location else self.message
