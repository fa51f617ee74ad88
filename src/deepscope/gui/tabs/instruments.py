"""The Instruments tab: a Cockpit-like dashboard of training-dynamics quantities.

One plotly panel per instrument, all computed by one callback; a failing or missing quantity
only affects its own panel. A quantity the run did not record says "not tracked".
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

import dash
import numpy as np
import pandas as pd
from dash import Input, Output, State, ctx, html

from ... import catalogue
from .. import ids, ranks
from ..axes import series_figure
from ..data import ProjectData, RunData, fingerprint
from ..figures import Figure, base_layout, line_trace, message_figure, note, plain
from ..guard import contained, error_box, error_figure
from ..widgets import chart_box, dropdown, labelled, lazy_figures
from . import Tab, gate

VALUE = "instruments"
MAX_HIST_STEPS = 300  # columns of the gradient-histogram heatmap; more steps are thinned
MAX_HIST_BINS = 400   # rows of the common grid (the finest recorded bin width, up to this)
DRAWN = "inst-drawn"  # store: what the tab shows: {"key": `_key`, "warnings", "layers": hashes}
SHOWN = "inst-in"     # store: [run, slow version] while the tab is shown (`tabs.gate`)
FIGURES = "inst-figures"  # store: {chart id: figure} (widgets.lazy_figures)
VIEW = "inst-view"        # store: set when charts kept blank came near (widgets.lazy_figures)


@dataclass(frozen=True)
class Panel:
    """One dashboard panel: quantities drawn together, optionally some on a right axis."""

    title: str
    names: tuple[str, ...]
    right: tuple[str, ...] = ()
    markers: bool = False
    height: int = 240  # pixels; panels whose quantities may need one axis each are taller
    kpis: bool = False  # the run's KPIs are drawn with its quantities


def panels() -> dict[str, Panel]:
    """The Instruments panels, derived from the catalogue (its panels and which quantities
    name each), in display order."""
    return {key: Panel(p.title, catalogue.panel_quantities(key), p.right, p.markers, p.height,
                      p.kpis)
            for key, p in catalogue.PANELS.items()}


PANELS: dict[str, Panel] = panels()
SECTIONS: list[tuple[str, list[str]]] = [
    (section, [k for k, p in catalogue.PANELS.items() if p.section == section])
    for section in dict.fromkeys(p.section for p in catalogue.PANELS.values())]
PER_LAYER = catalogue.per_layer()


def _series(rd: RunData, name: str, layer: str) -> tuple[pd.DataFrame, str]:
    """Rows of `name` for `layer`, falling back to the whole model; and the layer used."""
    df = rd.quantities(name)
    rows = df[df["layer"] == layer]
    if rows.empty and layer:
        return df[df["layer"] == ""], ""
    return rows, layer


def _missing_reason(rows: pd.DataFrame) -> str:
    """Why a recorded quantity has no finite value (the instrument stores a reason)."""
    reasons = {m.get("reason") for m in rows["meta"] if isinstance(m, dict) and m.get("reason")}
    return "; ".join(sorted(reasons))[:160]


def render_panel(rd: RunData, panel: Panel, layer: str) -> Figure:
    """The figure of one panel for one run and layer ("" = whole model)."""
    if panel.names == ("GradHist1d",):
        return _histogram_panel(rd, panel, layer)
    left, right, used_layers, missing, remarks = [], [], set(), [], []
    for i, name in enumerate(panel.names):
        rows, used = _series(rd, name, layer)
        if rows.empty:
            missing.append(name)
            continue
        used_layers.add(used)
        trace = line_trace(name, rows["step"], rows["value"], i)
        if panel.markers:
            trace["mode"] = "markers"
        # a cadence (HessMaxEV in full): its sparser points are not gaps
        every = max((m.get("every", 1) for m in rows["meta"] if isinstance(m, dict)), default=1)
        said = [f"every {_ordinal(every)} instrumented step"] if every > 1 else []
        said += [_mark_noted(trace, rows)]
        if any(said):
            remarks.append(f"{name}: {', '.join(p for p in said if p)}")
        (right if name in panel.right else left).append(trace)
        if rows["value"].notna().sum() == 0:
            reason = _missing_reason(rows)
            missing.append(f"{name} (no value{': ' + reason if reason else ''})")
    if panel.kpis:
        left += _kpi_traces(rd, start=len(left) + len(right))
    if not left and not right:
        return message_figure(f"{', '.join(panel.names)}: not tracked in this run",
                              panel.title, height=panel.height)
    title = panel.title + ("" if not layer else f" · {layer}" if used_layers == {layer}
                           else " · whole model")
    if missing:
        remarks.insert(0, "not tracked: " + ", ".join(missing))
    return series_figure(title, left or right, right if left else (), height=panel.height,
                         remark="; ".join(remarks))


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _mark_noted(trace: dict[str, Any], rows: pd.DataFrame) -> str:
    """Draw the values stored with a note (HessMaxEV's Lanczos that did not converge: a
    lower bound; a quantity that assumes plain SGD) as hollow rings with the note in their
    hover; return what the panel's remark says of them ("" when none has a note)."""
    notes = {int(s): m["note"] for s, m, v in zip(rows["step"], rows["meta"], rows["value"])
             if isinstance(m, dict) and m.get("note") and np.isfinite(v)}
    if not notes:
        return ""
    shown = [notes.get(int(x)) for x in trace["x"]]
    # a long series is drawn without markers: there only the noted points get one
    size = trace["marker"]["size"] if "markers" in trace["mode"] else 0
    trace["mode"] = "markers" if trace["mode"] == "markers" else "lines+markers"
    trace["marker"] = {**trace["marker"],
                       "symbol": ["circle-open" if n else "circle" for n in shown],
                       "size": [10 if n else size for n in shown]}
    trace["customdata"] = ["".join("<br>" + plain(line) for line in textwrap.wrap(n, 70))
                           if n else "" for n in shown]
    trace["hovertemplate"] = trace["hovertemplate"].replace(
        "<extra>", "%{customdata}<extra>")
    return f"{len(notes)} of {int(rows['value'].notna().sum())} values noted (rings, hover)"


def _kpi_traces(rd: RunData, start: int) -> list[dict[str, Any]]:
    kpis = rd.cached("kpis", lambda r: r.kpis())
    return [line_trace(f"kpi: {name}", g["step"], g["value"], start + i)
            for i, (name, g) in enumerate(kpis.groupby("name", sort=True))]


def _histogram_panel(rd: RunData, panel: Panel, layer: str) -> Figure:
    """GradHist1d as a heatmap: x = step, y = gradient value, colour = log10(1 + count).

    Ranges may differ between steps (adaptive bins): every column is re-binned onto one
    common grid, spreading each bin's count evenly over its width.
    """
    rows, used = _series(rd, "GradHist1d", layer)
    if rows.empty:
        return message_figure("GradHist1d: not tracked in this run", panel.title, height=240)
    steps = rows["step"].to_numpy()
    if steps.size > MAX_HIST_STEPS:
        steps = steps[np.linspace(0, steps.size - 1, MAX_HIST_STEPS).round().astype(int)]
    found, outside = [], 0
    with rd.reading() as run:
        for step in steps:
            hist = run.histogram("GradHist1d", int(step), used, missing_ok=True)
            if hist.missing:  # recorded as missing at this step (the reason is in its meta)
                continue
            (edges,) = hist.edges  # (the reader checked the counts against the edges)
            found.append((int(step), float(edges[0]), float(edges[-1]),
                          hist.counts.astype(float)))
            outside += hist.outside
    if not found:
        return message_figure("GradHist1d: recorded, but no histogram was computed",
                              panel.title, height=240)
    lo = min(f[1] for f in found)
    hi = max(f[2] for f in found)
    finest = min((b - a) / counts.size for _, a, b, counts in found)
    n = int(min(max(round((hi - lo) / finest), max(f[3].size for f in found)), MAX_HIST_BINS))
    grid = np.linspace(lo, hi, n + 1)
    columns = []
    for _, a, b, counts in found:
        cdf = np.concatenate([[0.0], np.cumsum(counts)])
        columns.append(np.diff(np.interp(grid, np.linspace(a, b, counts.size + 1), cdf)))
    z = np.log10(1.0 + np.stack(columns, axis=1))
    centres = (grid[:-1] + grid[1:]) / 2
    data = [{"type": "heatmap", "x": [f[0] for f in found], "y": centres.tolist(),
             "z": z.tolist(), "colorscale": "Viridis",
             "colorbar": {"title": {"text": "log10(1+n)"}, "thickness": 10},
             "hovertemplate": "step %{x}<br>g ≈ %{y:.3g}: 10^%{z:.2f}<extra></extra>"}]
    layout = base_layout(panel.title, height=240, yaxis={"title": {"text": "value"}})
    if outside:
        layout["annotations"] = [note(f"{outside} outside the range or non-finite")]
    return {"data": data, "layout": layout}


def section_warnings(rd: RunData) -> list[list[str]]:
    """Per section of SECTIONS: one line for each recording warning of the run that affects
    a quantity drawn there (a warning about no quantity in particular: the first section)."""
    table = rd.cached("warnings", lambda r: r.warnings())
    if "rank" in table:  # a distributed run: every rank's, each warning once
        table = ranks.distinct_warnings(table, rd.run.ranks)
    out: list[list[str]] = [[] for _ in SECTIONS]
    for row in table.itertuples(index=False):
        step = "" if row.step is None or row.step != row.step else f"step {int(row.step)} · "
        where = f"{row.location}: " if row.location else ""
        hit = False
        for i, (_, keys) in enumerate(SECTIONS):
            shown = [q for k in keys for q in PANELS[k].names if q in row.quantities]
            if shown:
                out[i].append(f"⚠ {step}{where}{row.message} (affects {', '.join(shown)})")
                hit = True
        if not hit:
            out[0].append(f"⚠ {step}{where}{row.message}")
    return out


def layer_options(rd: RunData) -> list[dict[str, str]]:
    """Whole model plus every layer any per-layer quantity recorded."""
    layers: set[str] = set()
    for name in catalogue.per_layer():
        layers.update(rd.quantities(name)["layer"])
    layers.discard("")
    return [{"label": "whole model", "value": ""}] + [{"label": x, "value": x}
                                                      for x in sorted(layers)]


def layout(_run_options: list[dict[str, str]]) -> html.Div:
    """The Cockpit-like dashboard: one chart per panel, grouped in sections."""
    sections = []
    for i, (title, keys) in enumerate(SECTIONS):
        sections.append(html.Section([
            html.H2(title),
            html.Div(id=f"inst-warnings-{i}", className="inst-warnings"),  # beside the charts
            html.Div([chart_box(f"inst-{k}", PANELS[k].height) for k in keys],
                     className="panel-grid"),
        ], className="card"))
    return html.Div([
        html.Div([labelled("Layer", dropdown("inst-layer", value="")),
                  html.Span("Per-layer values where the instrument records them; "
                            "a quantity the run did not record says 'not tracked'.",
                            className="hint")], className="toolbar card"),
        ranks.strip(),
        *sections,
    ], className="instruments")


def _key(run: str, layer: str, version: Any) -> list[Any]:
    """What the drawn panels show: redrawn only when this changes. `version`: the page's
    slow version store ({"versions": {run: token}, ...})."""
    return [run, layer, (version or {}).get("versions", {}).get(run)]


def register(app: dash.Dash, project: ProjectData) -> None:
    """Callbacks of the Instruments tab; they run only while the tab is shown.

    The layer choices, all panels and the warnings are one callback: one request and one
    render pass per change (one request per panel made the browser's rendering, not the
    server, the bottleneck); a panel that fails still shows its own error. Coming back to
    the tab with nothing changed asks nothing: the charts keep their figures. The answer is
    kept per run version (`cached_dashboard`), and the browser draws the charts in the
    window first, the others when they come near it (`widgets.lazy_figures`).
    """
    gate(app, VALUE, SHOWN, (ids.RUN, "value"), (ids.VERSION_SLOW, "data"))
    lazy_figures(app, FIGURES, VIEW, [f"inst-{k}" for k in PANELS])

    @app.callback(Output("inst-layer", "options"), Output("inst-layer", "value"),
                  Output(FIGURES, "data"),
                  *[Output(f"inst-warnings-{i}", "children") for i in range(len(SECTIONS))],
                  Output(DRAWN, "data"), Input(SHOWN, "data"), Input("inst-layer", "value"),
                  State(DRAWN, "data"), prevent_initial_call=True)
    def _draw(shown: list | None, layer: str | None, drawn: dict | None) -> tuple:
        run, version = shown or (None, None)
        if not run:
            raise dash.exceptions.PreventUpdate
        rd = project.run(run)
        drawn = drawn or {}
        now = dict(drawn)
        options, asked = dash.no_update, layer or ""
        if ctx.triggered_id == SHOWN:  # another run or new data: its layers
            options = rd.answer("instruments:layers", lambda: layer_options(rd))
            if asked not in {o["value"] for o in options}:
                asked = ""
            now["layers"] = fingerprint(options)
        now["key"] = _key(run, asked, version)
        if drawn.get("key") == now["key"]:
            raise dash.exceptions.PreventUpdate
        figures, warnings = cached_dashboard(rd, asked)
        now["warnings"] = fingerprint(warnings)
        # what did not change is not sent: the browser then re-renders neither
        return (options if now.get("layers") != drawn.get("layers") else dash.no_update,
                asked if asked != (layer or "") else dash.no_update, figures,
                *(warning_children(warnings) if now["warnings"] != drawn.get("warnings")
                  else [dash.no_update] * len(SECTIONS)), now)


def warning_children(warnings: list[list[str]] | str) -> list[list[Any]]:
    """Each section's warnings as paragraphs (`section_warnings`), or an error message in
    the first section."""
    if isinstance(warnings, str):
        return [[error_box(warnings)]] + [[] for _ in SECTIONS[1:]]
    return [[html.P(line) for line in lines] for lines in warnings]


def dashboard(rd: RunData, layer: str
              ) -> tuple[dict[str, Figure], list[list[str]] | str, bool]:
    """Every panel's figure ({chart id: figure}) and each section's warnings (its lines, or
    why they could not be read) for one run and layer ("" = whole model), and whether a part
    failed (its error shown in its place)."""
    failed: list[str] = []

    def failing(show: Any) -> Any:
        def on_error(msg: str) -> Any:
            failed.append(msg)
            return show(msg)
        return on_error
    figures = {f"inst-{k}": contained(lambda p=p: render_panel(rd, p, layer),
                                      failing(lambda msg, p=p: error_figure(msg, p.title,
                                                                            p.height)), p.title)
               for k, p in PANELS.items()}
    warnings = contained(lambda: section_warnings(rd), failing(lambda msg: f"warnings: {msg}"),
                         "warnings")
    return figures, warnings, bool(failed)


def cached_dashboard(rd: RunData, layer: str
                     ) -> tuple[dict[str, Figure], list[list[str]] | str]:
    """`dashboard(rd, layer)`'s figures and warnings, built once per run version: switching
    back and forth between runs asks no query and builds no figure. An answer in which a
    part failed is not kept (the next switch tries again)."""
    figures, warnings, _ = rd.answer(f"instruments:{layer}", lambda: dashboard(rd, layer),
                                     keep=lambda answer: not answer[2])
    return figures, warnings


TAB = Tab("Instruments", VALUE, layout, register, stores=(DRAWN, SHOWN, FIGURES, VIEW))
