"""The KPIs tab: the KPIs of the chosen runs overlaid, with exponential smoothing.

Its callback runs only while the tab is shown (and once more when shown after new data),
so the graph tab's clicks never pay for it.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, dcc, html

from .. import ids
from ..data import ProjectData
from ..figures import SERIES_COLOURS, base_layout, ema, line_trace
from ..guard import contained, error_box, guard
from ..widgets import GRAPH_CONFIG, dropdown, labelled
from . import Tab, gate

VALUE = "kpis"
RUNS = "kpi-runs"  # the runs overlaid (the poll keeps its options current)
SHOWN = "kpi-in"   # store: [slow version] while the tab is shown (`tabs.gate`)


def layout(run_options: list[dict[str, str]]) -> html.Div:
    """KPIs of the chosen runs overlaid, with exponential smoothing."""
    return html.Div([
        html.Div([
            labelled("Runs", dropdown(RUNS, options=run_options, multi=True,
                                      value=[o["value"] for o in run_options])),
            labelled("Smoothing", dcc.Slider(id="kpi-smooth", min=0, max=0.99, step=0.01,
                                             value=0.6, marks={0: "0", 0.6: "0.6",
                                                               0.99: "0.99"},
                                             allow_direct_input=False), "smooth-ctl"),
        ], className="toolbar card"),
        html.Div(id="kpi-charts", className="panel-grid"),
    ], className="kpis")


def kpi_charts(project: ProjectData, runs: list[str], smoothing: float) -> list[Any]:
    """One chart per KPI name; each run a faint raw line and a bold smoothed one. A run that
    cannot be read is named below the charts; the other runs still show."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    problems: list[Any] = []
    for i, name in enumerate(runs):
        kpis = contained(lambda name=name: project.run(name).cached("kpis", lambda r: r.kpis()),
                         lambda msg, name=name: problems.append(error_box(f"{name}: {msg}")),
                         f"KPIs of {name}")
        if kpis is None:
            continue
        colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
        for kpi, g in kpis.groupby("name", sort=True):
            raw = line_trace(f"{name} (raw)", g["step"], g["value"], i)
            raw.update(mode="lines", opacity=0.3, showlegend=False, hoverinfo="skip")
            traces = by_name.setdefault(kpi, [])
            traces.append(raw)
            if smoothing > 0:
                smooth = line_trace(name, g["step"], ema(g["value"].tolist(), smoothing), i)
                smooth.update(mode="lines", line={"width": 2, "color": colour})
                traces.append(smooth)
            else:
                raw.update(opacity=1, showlegend=True, name=name, hoverinfo=None)
    if not by_name:
        return [html.P("No KPIs logged in the selected runs (rec.kpi(name, value)).",
                       className="hint card"), *problems]
    return [html.Div(dcc.Graph(figure={"data": traces, "layout": base_layout(
        kpi, height=280)}, config=GRAPH_CONFIG),
        className="card", **{"data-kpi": kpi}) for kpi, traces in by_name.items()] + problems


def register(app: dash.Dash, project: ProjectData) -> None:
    gate(app, VALUE, SHOWN, (ids.VERSION_SLOW, "data"))

    @app.callback(Output("kpi-charts", "children"), Input(SHOWN, "data"),
                  Input(RUNS, "value"), Input("kpi-smooth", "value"),
                  prevent_initial_call=True)
    @guard(lambda msg: [error_box(msg)])
    def _kpis(shown: Any, runs: list[str] | None, smoothing: float | None) -> list[Any]:
        if shown is None:  # never shown yet (the runs' options arrived with the poll)
            raise dash.exceptions.PreventUpdate
        present = [r for r in runs or [] if r in project.runs()]
        return kpi_charts(project, present, float(smoothing or 0))


TAB = Tab("KPIs", VALUE, layout, register, run_lists=(RUNS,), stores=(SHOWN,))
