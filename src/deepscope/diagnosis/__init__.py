"""Diagnoses: the likely bug behind a run, named from what the run recorded.

`diagnose(run)` reads a run through the query API (loss KPI, statistics, instruments, anomaly
findings, the dependency graph) and returns `Diagnosis` rows, most likely first; those with
`confidence >= THRESHOLD` are reported. `Run.diagnoses()` gives them as a DataFrame and
`deepscope doctor RUN` prints them. Each code is documented in docs/diagnosis.md.
"""

from __future__ import annotations

import pandas as pd

from ..query.run import Run
from .activations import bad_input_scale, dead_units, saturation
from .base import THRESHOLD, Diagnosis, Evidence, Missing
from .gradients import gradient_scale, non_finite, not_updated
from .optimisation import learning_rate, missing_zero_grad, noisy_batch

CODES: tuple[str, ...] = (
    "lr_too_high", "lr_too_low", "exploding_gradients", "vanishing_gradients", "dead_units",
    "saturation", "missing_zero_grad", "not_updated", "not_learning", "noisy_batch",
    "non_finite", "bad_input_scale")

COLUMNS = ["code", "confidence", "step", "where", "summary", "evidence", "fix"]


def examine(run: Run, rank: int = 0) -> tuple[list[Diagnosis], list[Missing]]:
    """Every diagnosis (any confidence), most likely first, and the evidence that was missing."""
    ev = Evidence(run, rank)
    saturated = saturation(ev)
    found = [*non_finite(ev), *learning_rate(ev), *missing_zero_grad(ev), *noisy_batch(ev),
             *gradient_scale(ev), *not_updated(ev), *dead_units(ev), *saturated,
             *bad_input_scale(ev, saturated)]
    found.sort(key=lambda d: (-d.confidence, CODES.index(d.code), d.where))
    return found, ev.missing


def diagnose(run: Run, rank: int = 0, threshold: float = THRESHOLD) -> list[Diagnosis]:
    """The diagnoses with confidence >= threshold, most likely first."""
    return [d for d in examine(run, rank)[0] if d.confidence >= threshold]


def frame(diagnoses: list[Diagnosis]) -> pd.DataFrame:
    """Diagnoses as a DataFrame with `COLUMNS` (step is nullable Int64)."""
    df = pd.DataFrame([d.as_row() for d in diagnoses], columns=COLUMNS)
    return df.astype({"step": "Int64", "confidence": float})


__all__ = ["CODES", "COLUMNS", "THRESHOLD", "Diagnosis", "Missing", "diagnose", "examine",
           "frame"]
