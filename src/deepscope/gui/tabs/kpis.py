"""The KPIs tab: the KPIs of the chosen runs overlaid, with exponential smoothing.

Its callback runs only while the tab is shown (and once more when shown after new data),
so the graph tab's clicks never pay for it.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, dcc, html

from .. import ids, ranks
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


def run_kpis(project: ProjectData, name: str, rank: str | None) -> list[tuple[str, Any]]:
    """(legend name, KPI table) of one run: for a distributed run the chosen rank's, or one
    per rank ("all"); KPIs are logged per rank, so the global choice shows rank 0's (the
    lowest rank with a file)."""
    rd = project.run(name)
    q = ranks.query_rank(rd, rank)
    if q is None:
        return [(name, rd.cached("kpis", lambda r: r.kpis()))]
    present = ranks.rank_info(rd)["ranks"]  # (rank 0's file may be missing)
    shown = present if q == ranks.ALL else present[:1] if q == "merged" else [q]
    return [(f"{name} · rank {k}", rd.cached(f"kpis:{k}", lambda r, k=k: r.kpis(rank=k)))
            for k in shown]


def kpi_charts(project: ProjectData, runs: list[str], smoothing: float,
               rank: str | None = None) -> list[Any]:
    """One chart per KPI name; each run (each rank of a distributed run where `rank`, the
    rank selector's value, says "all") a faint raw line and a bold smoothed one. A run that
    cannot be read is named below the charts; the other runs still show."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    problems: list[Any] = []
    series: list[tuple[str, Any]] = []
    for name in runs:
        def failed(msg: str, name: str = name) -> list:
            problems.append(error_box(f"{name}: {msg}"))
            return []
        series += contained(lambda name=name: run_kpis(project, name, rank), failed,
                            f"KPIs of {name}")
    for i, (name, kpis) in enumerate(series):
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
    gate(app, VALUE, SHOWN, (ids.VERSION_SLOW, "data"), (ids.RANK, "value"))

    @app.callback(Output("kpi-charts", "children"), Input(SHOWN, "data"),
                  Input(RUNS, "value"), Input("kpi-smooth", "value"),
                  State(ids.RANK, "value"), prevent_initial_call=True)
    @guard(lambda msg: [error_box(msg)])
    def _kpis(shown: Any, runs: list[str] | None, smoothing: float | None,
              rank: str | None) -> list[Any]:
        if shown is None:  # never shown yet (the runs' options arrived with the poll)
            raise dash.exceptions.PreventUpdate
        present = [r for r in runs or [] if r in project.runs()]
        return kpi_charts(project, present, float(smoothing or 0), rank)


TAB = Tab("KPIs", VALUE, layout, register, run_lists=(RUNS,), stores=(SHOWN,))
