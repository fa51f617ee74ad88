"""The value range a chart shows: the bulk of the points, not a few far-out ones.

Shared by the GUI (plotly) and `deepscope plot` (matplotlib): one α of −1100 among values near
0, or one TICDiag burst, would otherwise set the axis and flatten every other point.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# Points within FENCE interquartile ranges of the middle half stay inside (Tukey's far-out
# fences are 3); points beyond are clipped, and the charts mark them at the edge.
FENCE = 3.0
COVER = 0.9  # ... yet the range always holds at least this share of the points


def finite(values: Sequence[Any]) -> np.ndarray:
    """The finite values as float64 (None, NaN and ±Inf dropped)."""
    v = np.asarray([np.nan if x is None else x for x in values], dtype=float)
    return v[np.isfinite(v)]


def bulk_range(values: Sequence[Any], log: bool = False) -> tuple[float, float] | None:
    """(lo, hi) of the points' bulk, unpadded (log10 units if `log`: positive values only);
    None without a finite value."""
    v = finite(values)
    if log:
        v = np.log10(v[v > 0])
    if not v.size:
        return None
    q1, q3 = np.percentile(v, (25.0, 75.0))
    # heavy tails: never fewer than COVER of the points inside (5% at most beyond each end)
    q_lo = np.percentile(v, 50 * (1 - COVER), method="higher")
    q_hi = np.percentile(v, 50 * (1 + COVER), method="lower")
    return (min(max(float(v.min()), q1 - FENCE * (q3 - q1)), float(q_lo)),
            max(min(float(v.max()), q3 + FENCE * (q3 - q1)), float(q_hi)))


def log_fits(values: Sequence[Any]) -> bool:
    """Log scale suits strictly positive data whose bulk spans more than two decades."""
    v = finite(values)
    if not v.size or (v <= 0).any():
        return False
    lo, hi = bulk_range(v, log=True) or (0.0, 0.0)
    return hi - lo > 2


def shared_range(series: Sequence[Sequence[Any]], log: bool = False
                 ) -> tuple[float, float] | None:
    """The union of each series' `bulk_range`: several quantities on one axis each keep
    their own bulk in view (one series' many points must not push another's out)."""
    found = [r for r in (bulk_range(v, log) for v in series) if r is not None]
    if not found:
        return None
    return min(lo for lo, _ in found), max(hi for _, hi in found)
