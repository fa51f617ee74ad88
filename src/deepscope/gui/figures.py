"""Plotly figures as plain dicts: no figure-object validation on the click path (it costs
tens of milliseconds on large series), and the same look in every panel."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Figure = dict[str, Any]

# Okabe-Ito: distinguishable for colour-blind readers, one colour per overlaid run.
SERIES_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9",
                  "#F0E442", "#000000")
# Point markers only while they stay legible (several pixels apart on a ~400 px panel) and
# cheap: each marker is an SVG element; 75-point lines with markers took plotly 2-4x as long
# to draw (the Instruments dashboard's run switch, issue 21).
MARKERS_UP_TO = 50
MAX_POINTS = 2000    # a line holds at most this many points: more than a chart has pixels
# values_figure draws at most this many values (a ~20 MB response); larger arrays are named,
# not drawn, so one array cannot make a response of hundreds of MB.
MAX_DRAWN_VALUES = 1_000_000


def plain(text: str) -> str:
    """`text` shown as it is: Plotly renders a subset of HTML (<b>, <a href>, <br>) in
    titles, legends, hover labels and annotations, and run, tensor, KPI and layer names come
    from the file, so their markup characters become entities."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def base_layout(title: str = "", *, height: int = 260, **extra: Any) -> dict[str, Any]:
    """The common plotly layout; `extra` keys are merged into it (dicts one level deep)."""
    title = plain(title)
    layout: dict[str, Any] = {
        "title": {"text": title, "font": {"size": 13}, "x": 0.01, "xanchor": "left"},
        # the mode bar stands upright in the right margin: across the top it covered titles
        "height": height, "margin": {"l": 56, "r": 34, "t": 34 if title else 12, "b": 38},
        "modebar": {"orientation": "v"},
        "paper_bgcolor": "#ffffff", "plot_bgcolor": "#ffffff",
        "font": {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif",
                 "size": 11},
        "xaxis": {"gridcolor": "#ececec", "zeroline": False, "automargin": True},
        "yaxis": {"gridcolor": "#ececec", "zeroline": False, "automargin": True},
        # below the plot; x axes over steps carry no title, so nothing overlaps it
        "legend": {"orientation": "h", "y": -0.16, "yanchor": "top", "x": 0},
        "hovermode": "closest", "uirevision": title,
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(layout.get(key), dict):
            layout[key] = {**layout[key], **value}
        else:
            layout[key] = value
    return layout


def integer_axis(count: int) -> dict[str, Any]:
    """Axis settings for indices (neurons, batch items): no 0.5 ticks on short axes."""
    return {"dtick": 1} if count <= 20 else {}


def note(text: str) -> dict[str, Any]:
    """A small grey remark at the top right of a chart (what is missing, what was thinned)."""
    return {"text": plain(text), "showarrow": False, "xref": "paper", "yref": "paper", "x": 1,
            "y": 1.0, "xanchor": "right", "yanchor": "bottom",
            "font": {"size": 10, "color": "#888"}}


def message_figure(text: str, title: str = "", *, height: int = 260) -> Figure:
    """An empty panel that says why it is empty ("not tracked", an error, ...)."""
    layout = base_layout(title, height=height)
    layout["xaxis"] = {"visible": False}
    layout["yaxis"] = {"visible": False}
    layout["annotations"] = [{"text": plain(text), "showarrow": False, "xref": "paper",
                              "yref": "paper", "x": 0.5, "y": 0.5,
                              "font": {"size": 13, "color": "#666"}}]
    return {"data": [], "layout": layout}


def _finite_or_none(values: Any) -> list[float | None]:
    """JSON has no NaN: gaps become None, which plotly draws as a break in the line."""
    return [v if math.isfinite(v) else None for v in np.asarray(values, dtype=float).tolist()]


def decimate(x: np.ndarray, y: np.ndarray,
             max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ~max_points points: of each run of consecutive points keep the minimum, the
    maximum and the first non-finite one, so spikes and gaps (NaN, Inf) survive."""
    n = len(x)
    if n <= max_points:
        return x, y
    size = -(-n // (max_points // 3))
    rows = -(-n // size)
    padded = np.concatenate([y, np.full(rows * size - n, np.nan)]).reshape(rows, size)
    real = (np.arange(rows * size) < n).reshape(rows, size)
    finite = np.isfinite(padded)
    base = np.arange(rows) * size
    keep = [base + np.where(finite, padded, np.inf).argmin(1),
            base + np.where(finite, padded, -np.inf).argmax(1)]
    odd = real & ~finite
    keep.append((base + odd.argmax(1))[odd.any(1)])
    index = np.unique(np.concatenate(keep))
    index = index[index < n]
    return x[index], y[index]


def line_trace(name: str, x: Sequence[Any], y: Sequence[Any], colour_index: int = 0,
               *, dash: str | None = None, yaxis: str | None = None) -> dict[str, Any]:
    """A line over steps; long series are decimated (see `decimate`), the name says so."""
    xs, ys = np.asarray(x, dtype=np.int64), np.asarray(y, dtype=float)
    shown_x, shown_y = decimate(xs, ys)
    if len(shown_x) < len(xs):
        name = f"{name} (min/max of {len(xs)} points)"
    name = plain(name)
    trace: dict[str, Any] = {
        "type": "scatter", "name": name, "x": shown_x.tolist(), "y": _finite_or_none(shown_y),
        "mode": "lines+markers" if len(shown_x) <= MARKERS_UP_TO else "lines",
        "line": {"width": 1.6, "color": SERIES_COLOURS[colour_index % len(SERIES_COLOURS)]},
        "marker": {"size": 5}, "hovertemplate": f"{name}<br>step %{{x}}: %{{y:.4g}}"
                                                "<extra></extra>"}
    if dash:
        trace["line"]["dash"] = dash
    if yaxis:
        trace["yaxis"] = yaxis
    return trace


def step_marker(step: int | None) -> list[dict[str, Any]]:
    """A vertical line at the selected step."""
    if step is None:
        return []
    return [{"type": "line", "xref": "x", "yref": "paper", "x0": step, "x1": step, "y0": 0,
             "y1": 1, "line": {"color": "#999", "width": 1, "dash": "dot"}}]


def values_figure(values: np.ndarray, title: str, *, xtitle: str = "neuron") -> Figure:
    """A bar chart for 1-D values, a heatmap for 2-D (rows x columns); over
    MAX_DRAWN_VALUES values, a message saying so."""
    if values.size > MAX_DRAWN_VALUES:
        return message_figure(f"{values.size:,} values ({'x'.join(map(str, values.shape))}): "
                              f"more than the {MAX_DRAWN_VALUES:,} a chart draws; read them "
                              "with deepscope.open_run(...).values(...)", title)
    if values.ndim <= 1:
        v = values.reshape(-1)
        data = [{"type": "bar", "x": list(range(v.size)), "y": _finite_or_none(v),
                 "marker": {"color": ["#b00020" if not math.isfinite(x) else "#0072B2"
                                      for x in v.tolist()]},
                 "hovertemplate": f"{xtitle} %{{x}}: %{{y:.4g}}<extra></extra>"}]
        layout = base_layout(title, xaxis={"title": {"text": xtitle}, **integer_axis(v.size)},
                             bargap=0.05)
        return {"data": data, "layout": layout}
    z = values.reshape(-1, values.shape[-1])
    data = [{"type": "heatmap", "z": [_finite_or_none(row) for row in z],
             "colorscale": "RdBu", "zmid": 0, "reversescale": True,
             "hovertemplate": "row %{y}, col %{x}: %{z:.4g}<extra></extra>"}]
    layout = base_layout(title, xaxis={"title": {"text": "last dimension"},
                                       **integer_axis(z.shape[1])},
                         yaxis={"title": {"text": "row"}, "autorange": "reversed",
                                **integer_axis(z.shape[0])})
    return {"data": data, "layout": layout}


def share_scale(fig: Figure, other: Figure) -> None:
    """Give `fig` the value scale covering both figures' values (bar y-axis or heatmap
    colours), so two charts side by side compare at a glance. Modifies `fig`."""
    def values(f: Figure) -> list[float]:
        out: list[float] = []
        for trace in f.get("data", []):
            rows = trace.get("z") or [trace.get("y") or []]
            out += [v for row in rows for v in row if v is not None]
        return out
    both = values(fig) + values(other)
    if not both or not fig.get("data"):
        return
    lo, hi = min(both), max(both)
    trace = fig["data"][0]
    if trace.get("type") == "heatmap":
        top = max(abs(lo), abs(hi)) or 1.0
        trace.update(zmin=-top, zmax=top)
        trace.pop("zmid", None)
    else:
        lo, hi = min(lo, 0.0), max(hi, 0.0)  # bars start at zero
        pad = 0.05 * ((hi - lo) or 1.0)
        fig["layout"]["yaxis"] = {**fig["layout"].get("yaxis", {}),
                                  "range": [lo - pad, hi + pad], "autorange": False}


def ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard-style exponential smoothing with debiasing (weight 0 = raw); gaps skip."""
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(math.nan)
            continue
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(acc / norm)
    return out
