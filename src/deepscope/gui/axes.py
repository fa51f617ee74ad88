"""Readable value axes for series over steps: a range that fits the bulk of the points with
the outliers marked at its edge, log ticks one per decade, and one axis per quantity when
quantities drawn together differ in scale.

A few spikes (α of −1100 among values near 0, a TICDiag burst) would otherwise set the axis
range and flatten every other point into a line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..ranges import bulk_range, finite, log_fits, shared_range
from .figures import Figure, base_layout, note

SCALE_RATIO = 10.0  # quantities whose typical sizes differ more than this get their own axis


def robust_range(values: Sequence[Any], log: bool = False, *,
                 series: Sequence[Sequence[Any]] = ()) -> tuple[float, float] | None:
    """(lo, hi) of the axis in data units (log10 units for a log axis): the points' bulk
    (see `ranges.bulk_range`; with `series`, the union of each one's), padded; None to let
    plotly choose (no finite value)."""
    bulk = shared_range(series, log) if series else bulk_range(values, log)
    if bulk is None:
        return None
    lo, hi = bulk
    pad = 0.06 * (hi - lo) if hi > lo else (0.5 if log else 0.1 * abs(hi) or 1.0)
    return lo - pad, hi + pad


def outlier_trace(trace: dict[str, Any], bounds: tuple[float, float], log: bool
                  ) -> dict[str, Any] | None:
    """Markers at the axis edge for the points of `trace` outside `bounds` (▲ above, ▼ below),
    their hover text giving the true value; None when every point is inside."""
    lo, hi = (10 ** b for b in bounds) if log else bounds
    xs, ys, symbols, text = [], [], [], []
    for x, y in zip(trace["x"], trace["y"]):
        if y is None or lo <= y <= hi:
            continue
        above = y > hi
        xs.append(x)
        ys.append(hi if above else lo)
        symbols.append("triangle-up" if above else "triangle-down")
        text.append(f"{trace['name']}: {y:.4g} at step {x} (outside the range)")
    if not xs:
        return None
    out = {"type": "scatter", "mode": "markers", "x": xs, "y": ys, "text": text,
           "hovertemplate": "%{text}<extra></extra>", "showlegend": False,
           "cliponaxis": False, "name": f"{trace['name']} outside",
           "marker": {"symbol": symbols, "size": 9, "color": trace["line"]["color"],
                      "line": {"width": 1, "color": "#333"}}}
    if trace.get("yaxis"):
        out["yaxis"] = trace["yaxis"]
    return out


def value_axis(traces: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], list[dict], int]:
    """Axis settings fitted to `traces` (all on one axis), their outlier markers, and how many
    points lie outside the range."""
    values = [y for t in traces for y in t["y"]]
    log = log_fits(values)
    axis: dict[str, Any] = {"type": "log", "dtick": 1, "exponentformat": "power",
                            "minor": {"showgrid": False}} if log else {}
    bounds = robust_range(values, log, series=[t["y"] for t in traces])
    if bounds is None:
        return axis, [], 0
    axis.update(range=list(bounds), autorange=False)
    marks = [m for m in (outlier_trace(t, bounds, log) for t in traces) if m]
    return axis, marks, sum(len(m["x"]) for m in marks)


def _typical(trace: dict[str, Any]) -> float:
    v = np.abs(finite(trace["y"]))
    return float(np.median(v)) if v.size else math.nan


def scale_groups(traces: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The traces grouped so that typical magnitudes within a group differ at most
    `SCALE_RATIO`-fold (smallest first); a trace without a typical size joins the first."""
    sized = sorted((s, i) for i, s in enumerate(map(_typical, traces))
                   if math.isfinite(s) and s > 0)
    groups: list[list[int]] = []
    for size, i in sized:
        if groups and size <= SCALE_RATIO * _typical(traces[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    rest = [i for i in range(len(traces)) if all(i not in g for g in groups)]
    if not groups:
        return [list(traces)] if traces else []
    groups[0] += rest
    return [[traces[i] for i in sorted(g)] for g in sorted(groups, key=min)]


def series_figure(title: str, left: list[dict[str, Any]], right: Sequence[dict[str, Any]] = (),
                  *, height: int = 240, remark: str = "") -> Figure:
    """A chart of lines over steps with readable value axes, `height` pixels in all.

    `left` traces share the left axis while their scales agree; quantities of different
    scale get one axis each, stacked in rows over one step axis (each row labelled).
    `right` traces share a right axis (a second unit, e.g. UpdateSize beside Distance).
    `remark` (what is missing) heads the grey note at the top right. `left` is not empty.
    """
    rows = scale_groups(left)
    n = len(rows)
    layout = base_layout(title, height=height, showlegend=n == 1)
    data: list[dict[str, Any]] = []
    outside = 0
    gap = 0.1 if n > 1 else 0.0
    labels = []
    plain = layout["yaxis"]  # each row starts from the common look, not the row above
    for i, row in enumerate(rows):
        name, key = ("y", "yaxis") if i == 0 else (f"y{i + 1}", f"yaxis{i + 1}")
        axis, marks, k = value_axis(row)
        outside += k
        top = 1 - i / n
        axis["domain"] = [max(0.0, top - 1 / n + (gap if i < n - 1 else 0.0)), top]
        for t in row + marks:
            t["yaxis"] = name
        layout[key] = {**plain, **axis}
        data += row + marks
        if n > 1:  # the row's quantities, in their colours, above its top left corner
            labels.append({"text": " · ".join(
                f"<span style='color:{t['line']['color']}'>{t['name']}</span>" for t in row),
                "showarrow": False, "xref": "paper", "yref": "paper", "x": 0,
                "y": top, "xanchor": "left", "yanchor": "bottom", "font": {"size": 10}})
    layout["xaxis"] = {**layout["xaxis"], "anchor": "y" if n == 1 else f"y{n}"}  # below
    if right:
        axis, marks, k = value_axis(list(right))
        outside += k
        for t in list(right) + marks:
            t["yaxis"] = f"y{n + 1}"
        # own round ticks ("sync" would put them at the left axis' grid lines: 0.0347, ...)
        layout[f"yaxis{n + 1}"] = {"overlaying": "y", "side": "right", "showgrid": False,
                                   "automargin": True, "zeroline": False, "tickmode": "auto",
                                   **axis}
        # the upright mode bar needs its own strip right of the axis' labels
        layout["margin"] = {**layout["margin"], "r": layout["margin"]["r"] + 50}
        data += list(right) + marks
    remarks = [remark] if remark else []
    if outside:
        remarks.append(f"▲▼ {outside} point{'s' * (outside != 1)} outside the range (hover)")
    if remarks:
        labels.insert(0, note(" · ".join(remarks)))
    if labels:
        layout["annotations"] = labels
    return {"data": data, "layout": layout}
