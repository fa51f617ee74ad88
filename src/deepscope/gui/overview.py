"""Callbacks of the run-level tabs: KPIs (all runs overlaid), Compare, Notes.

Each runs only while its tab is shown, so the graph tab's clicks never pay for them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import dash
from dash import Input, Output, dcc, html

from . import panels
from .data import ProjectData
from .figures import (
    SERIES_COLOURS,
    base_layout,
    ema,
    line_trace,
    message_figure,
    share_scale,
)
from .guard import contained, error_box, figure_guard, guard
from .layout import GRAPH_CONFIG
from .selection import nearest_index


def register(app: dash.Dash, project: ProjectData) -> None:
    _register_kpis(app, project)
    _register_compare(app, project)
    _register_notes(app, project)


def _only_on(tab: str, wanted: str) -> None:
    if tab != wanted:
        raise dash.exceptions.PreventUpdate


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


def _register_kpis(app: dash.Dash, project: ProjectData) -> None:
    @app.callback(Output("kpi-charts", "children"), Input("tabs", "value"),
                  Input("kpi-runs", "value"), Input("kpi-smooth", "value"),
                  Input("version-slow", "data"))
    @guard(lambda msg: [error_box(msg)])
    def _kpis(tab: str, runs: list[str] | None, smoothing: float | None,
              _v: Any) -> list[Any]:
        _only_on(tab, "kpis")
        present = [r for r in runs or [] if r in project.runs()]
        return kpi_charts(project, present, float(smoothing or 0))


def _register_compare(app: dash.Dash, project: ProjectData) -> None:
    # Copy the selection only while the Compare tab is shown (in the browser, no request):
    # the graph tab's clicks then never wake the compare callbacks.
    app.clientside_callback(
        "function(tab, sel) { return tab === 'compare' ? sel : window.dash_clientside.no_update; }",
        Output("sel-compare", "data"), Input("tabs", "value"), Input("sel", "data"))

    @app.callback(Output("compare-what", "children"), Input("sel-compare", "data"),
                  Input("statistic", "value"))
    def _what(sel: dict | None, statistic: str | None) -> str:
        if not sel or not sel.get("tensor"):
            return "Select a tensor in the Graph tab."
        return (f"Same tensor, step and statistic in both runs: {sel['tensor']} "
                f"({sel['direction']}), {statistic or 'norm'} — choose them in the Graph tab.")

    for side in ("a", "b"):
        _register_compare_column(app, project, side)

    @app.callback(Output("compare-over-steps", "figure"), Input("sel-compare", "data"),
                  Input("compare-b", "value"), Input("statistic", "value"),
                  Input("version-slow", "data"))
    @figure_guard("over steps", 280)
    def _overlay(sel: dict | None, other: str | None, statistic: str | None, _v: Any) -> dict:
        if not sel or not sel.get("tensor"):
            raise dash.exceptions.PreventUpdate
        return panels.history(project, [sel["run"], *([other] if other else [])], sel,
                              statistic or "norm", height=280)


def _register_compare_column(app: dash.Dash, project: ProjectData, side: str) -> None:
    @app.callback(Output(f"compare-{side}-title", "children"),
                  Output(f"compare-{side}-table", "children"),
                  Output(f"compare-{side}-values", "figure"), Input("sel-compare", "data"),
                  Input("compare-b", "value"), Input("version-slow", "data"))
    @guard(lambda msg: ("error", error_box(msg), dash.no_update))
    def _column(sel: dict | None, other: str | None, _v: Any) -> tuple:
        if not sel or not sel.get("tensor"):
            raise dash.exceptions.PreventUpdate
        run = sel["run"] if side == "a" else other
        if not run:
            return _empty_column("run B", "Choose a run to compare with.")
        here = _compare_selection(project, sel, run)
        if isinstance(here, str):
            return _empty_column(run, here)
        rd = project.run(run)
        _banner, table = panels.stats_table(rd, here)
        fig = panels.values_panel(rd, here, 220)
        partner = other if side == "a" else sel["run"]
        there = _compare_selection(project, sel, partner) if partner else None
        if isinstance(there, dict):  # one value scale in both columns
            share_scale(fig, panels.values_panel(project.run(partner), there, 220))
        return f"{run} · step {here['step']}", table, fig


def _compare_selection(project: ProjectData, sel: dict, run: str) -> dict | str:
    """The selection of the Graph tab in `run` at its nearest recorded step, or why none."""
    rd = project.run(run)
    steps = rd.steps(sel["kind"])
    if not steps:
        return f"{run} has no recorded step of kind {sel['kind']}."
    if sel["tensor"] not in rd.tensor_info():
        return f"{run} has no tensor {sel['tensor']}."
    # the other run may have recorded other steps: take its nearest one
    return {**sel, "run": run, "step": steps[nearest_index(steps, sel["step"])]}


def _empty_column(title: str, text: str) -> tuple:
    return title, html.P(text, className="hint"), message_figure(text, height=220)


def _list_table(headers: list[str], rows: list[list[Any]]) -> html.Table:
    """A plain table of cells (the Notes tab)."""
    return html.Table([html.Thead(html.Tr([html.Th(h) for h in headers])),
                       html.Tbody([html.Tr(cells) for cells in rows])], className="list-table")


def _shown_frame(project: ProjectData, tab: str, wanted: str, run: str | None,
                 load: Callable[[Any], Any]) -> Any:
    """The selected run's `wanted` table (cached under that name) while its tab is shown;
    no update otherwise."""
    _only_on(tab, wanted)
    if not run:
        raise dash.exceptions.PreventUpdate
    return project.run(run).cached(wanted, load)


def _register_notes(app: dash.Dash, project: ProjectData) -> None:
    @app.callback(Output("notes", "children"), Input("tabs", "value"), Input("run", "value"),
                  Input("version-slow", "data"))
    @guard(lambda msg: error_box(msg))
    def _notes(tab: str, run: str | None, _v: Any) -> Any:
        notes = _shown_frame(project, tab, "notes", run, lambda r: r.notes())
        if notes.empty:
            return html.P(f"No notes in {run} (scope.note(text) adds one).", className="hint")
        return _list_table(["time", "step", "note"], [
            [html.Td(_when(t)), html.Td("" if s is None or s != s else int(s)),
             html.Td(text, className="note-text")]
            for t, s, text in notes[["wall_time", "step", "text"]].itertuples(index=False)])


def _when(wall_time: float) -> str:
    return dt.datetime.fromtimestamp(wall_time).strftime("%Y-%m-%d %H:%M:%S")
