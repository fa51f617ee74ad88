"""Diagnoses: the likely bug behind a run, named from what the run recorded.

`diagnose(run)` reads a run through the query API (loss KPI, statistics, instruments, anomaly
findings, the dependency graph) and returns `Diagnosis` rows, most likely first; those with
`confidence >= THRESHOLD` are reported. `Run.diagnoses()` gives them as a DataFrame and
`deepscope doctor RUN` prints them. Each code is documented in docs/diagnosis.md.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from ..errors import DeepscopeError
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
    checks: list[tuple[tuple[str, ...], Callable[[], list[Diagnosis]]]] = [
        (("non_finite",), lambda: non_finite(ev)),
        (("lr_too_high", "lr_too_low", "not_learning"), lambda: learning_rate(ev)),
        (("missing_zero_grad",), lambda: missing_zero_grad(ev)),
        (("noisy_batch",), lambda: noisy_batch(ev)),
        (("exploding_gradients", "vanishing_gradients"), lambda: gradient_scale(ev)),
        (("not_updated",), lambda: not_updated(ev)),
        (("dead_units",), lambda: dead_units(ev)),
        (("saturation",), lambda: saturation(ev)),
    ]
    found: list[Diagnosis] = []
    for codes, check in checks:
        found += _guarded(ev, codes, check)
    saturated = [d for d in found if d.code == "saturation"]
    found += _guarded(ev, ("bad_input_scale",), lambda: bad_input_scale(ev, saturated))
    found.sort(key=lambda d: (-d.confidence, CODES.index(d.code), d.where))
    return found, ev.missing


def _guarded(ev: Evidence, codes: tuple[str, ...],
             check: Callable[[], list[Diagnosis]]) -> list[Diagnosis]:
    """Run one check; an unexpected failure becomes a loud note, not a lost report (a
    damaged file still raises)."""
    try:
        return check()
    except DeepscopeError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the user, with the error
        ev.missing.append(Missing(codes, f"the check failed ({type(exc).__name__}: {exc}); "
                                  "please report it", ""))
        return []


def diagnose(run: Run, rank: int = 0, threshold: float = THRESHOLD) -> list[Diagnosis]:
    """The diagnoses with confidence >= threshold, most likely first."""
    return [d for d in examine(run, rank)[0] if d.confidence >= threshold]


def frame(diagnoses: list[Diagnosis]) -> pd.DataFrame:
    """Diagnoses as a DataFrame with `COLUMNS` (step is nullable Int64)."""
    df = pd.DataFrame([d.as_row() for d in diagnoses], columns=COLUMNS)
    return df.astype({"step": "Int64", "confidence": float})


__all__ = ["CODES", "COLUMNS", "THRESHOLD", "Diagnosis", "Missing", "diagnose", "examine",
           "frame"]
