"""What the static dashboard draws, read from a run in one go per redraw.

The drawing code never touches the store: it asks a `DashboardData` for a series, a
histogram or the KPI names, so a missing quantity is a `None` to draw as "not tracked"
rather than an exception in the middle of a figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .. import catalogue
from ..query import Project, Run
from ..store.layout import is_run_dir


@dataclass(frozen=True)
class Series:
    """One scalar over steps: a quantity of one layer, or a KPI.

    values are NaN where the value is missing or not finite; `reason` is the last stored
    explanation of a missing value ("" if none); `noted` marks the values stored with a note
    (e.g. HessMaxEV's lower bound where Lanczos did not converge), None when none is;
    `every`: computed on every such instrumented step (a cadence, e.g. HessMaxEV in full).
    """

    name: str
    steps: np.ndarray
    values: np.ndarray
    reason: str = ""
    noted: np.ndarray | None = None
    every: int = 1

    @property
    def finite(self) -> np.ndarray:
        """Mask of the steps with a finite value."""
        return np.isfinite(self.values)

    def last(self) -> float | None:
        """The most recent finite value, if any."""
        good = self.values[self.finite]
        return float(good[-1]) if good.size else None


@dataclass(frozen=True)
class HistogramAt:
    """A stored histogram (whole model) at one step: counts, their metadata and the bin
    edges per axis (2-D: θ axis first), as `deepscope.query.histogram.Histogram` decodes."""

    step: int
    counts: np.ndarray
    meta: dict[str, Any]
    edges: tuple[np.ndarray, ...] = ()


class DashboardData:
    """A run's instrument values, KPIs and latest histograms, up to `step`.

    Build it with `DashboardData.load(run, step)`; everything is read at once so that a
    redraw sees one consistent state of a run that is still being written.
    """

    def __init__(self, name: str, quantities: pd.DataFrame, kpis: pd.DataFrame,
                 histograms: dict[str, HistogramAt], declared: frozenset[str]) -> None:
        self.name = name
        self._quantities = quantities
        self._kpis = kpis
        self._histograms = histograms
        self._declared = declared
        steps = pd.concat([quantities["step"], kpis["step"]])
        self.last_step: int | None = int(steps.max()) if len(steps) else None
        # the step the instrument panels (histograms included) show
        self.last_quantity_step: int | None = (int(quantities["step"].max())
                                               if len(quantities) else None)

    @classmethod
    def load(cls, run: Run, step: int | None = None) -> DashboardData:
        """Read `run` as it was at `step` (default: everything recorded so far)."""
        quantities = run.quantities()
        kpis = run.kpis()
        if step is not None:
            quantities = quantities[quantities["step"] <= step]
            kpis = kpis[kpis["step"] <= step]
        stored = {}
        for name in catalogue.histograms():
            rows = quantities[(quantities["name"] == name) & (quantities["layer"] == "")]
            for at in reversed(rows["step"].tolist()):  # the latest one with counts
                hist = run.histogram(name, int(at), missing_ok=True)
                if not hist.missing:
                    stored[name] = HistogramAt(int(at), hist.counts, hist.meta, hist.edges)
                    break
        return cls(run.name, quantities, kpis, stored, _declared(run))

    # -- queries -------------------------------------------------------------------------
    def tracked(self, name: str) -> bool:
        """Whether the run computes `name` (declared by its instruments, or has values)."""
        return name in self._declared or self.series(name) is not None

    def series(self, name: str, layer: str = "") -> Series | None:
        """The quantity `name` of `layer` ("" = whole model), else the KPI `name`; None if
        the run has neither."""
        q = self._quantities
        rows = q[(q["name"] == name) & (q["layer"] == layer)]
        if len(rows):
            reasons = [m.get("reason", "") for m in rows["meta"] if m.get("reason")]
            values = rows["value"].to_numpy(np.float64)
            noted = np.array([bool(m.get("note")) for m in rows["meta"]]) & np.isfinite(values)
            every = max((int(m.get("every", 1)) for m in rows["meta"]), default=1)
            return Series(name, rows["step"].to_numpy(np.int64), values,
                          reasons[-1] if reasons else "", noted if noted.any() else None,
                          every)
        k = self._kpis
        rows = k[k["name"] == name].sort_values("step")
        if len(rows) and layer == "":
            return Series(name, rows["step"].to_numpy(np.int64),
                          rows["value"].to_numpy(np.float64))
        return None

    def layers(self, name: str) -> list[str]:
        """The per-layer (parameter tensor) names stored for quantity `name`."""
        q = self._quantities
        found = q.loc[(q["name"] == name) & (q["layer"] != ""), "layer"]
        return list(dict.fromkeys(found))

    def histogram(self, name: str) -> HistogramAt | None:
        """The latest stored whole-model histogram `name`, if any."""
        return self._histograms.get(name)

    def kpi_names(self) -> list[str]:
        """Names of the KPIs logged so far, sorted."""
        return sorted(set(self._kpis["name"]))


def open_for_plot(run_or_path: Run | str | Path) -> tuple[Run, bool]:
    """(run, whether the caller opened it and must close it), with a one-line error naming
    the fix for a path that is not a run folder."""
    if isinstance(run_or_path, Run):
        return run_or_path, False
    if not isinstance(run_or_path, (str, Path)):
        raise TypeError("plot_dashboard(...) needs a deepscope Run or the path of a run folder, "
                        f"got {type(run_or_path).__name__}")
    path = Path(run_or_path)
    if path.is_dir() and not is_run_dir(path):
        runs = Project(path).runs()
        if runs:
            raise ValueError(f"{path} is a project folder; pass one of its runs: "
                             + ", ".join(str(path / r) for r in runs))
    return Run(path), True


def _declared(run: Run) -> frozenset[str]:
    """Quantities the run's instruments were asked for (stored in its metadata)."""
    spec = run.meta().get("instruments")
    if not spec:
        return frozenset()
    try:
        return frozenset(catalogue.resolve_quantities(spec))
    except (TypeError, ValueError):  # written by another version: fall back to the values
        return frozenset()
