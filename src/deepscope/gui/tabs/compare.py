"""The Compare tab: the Graph tab's selected record in two runs side by side, and both
histories in one chart.

Its callbacks wake only while the tab is shown (and once when shown after the selection or
the data changed), so the graph tab's clicks never pay for them.
"""

from __future__ import annotations

import dash
from dash import Input, Output, html

from .. import ids, panels
from ..data import ProjectData
from ..figures import message_figure, share_scale
from ..guard import error_box, figure_guard, guard
from ..selection import nearest_index
from ..widgets import chart, dropdown, labelled
from . import Tab, gate

VALUE = "compare"
OTHER = "compare-b"        # run B (the poll keeps its options current)
SEL = "sel-compare"  # [Graph tab's selection, statistic, slow version] while shown (`gate`)


def layout(run_options: list[dict[str, str]]) -> html.Div:
    """The selected record in two runs side by side, and both histories in one chart."""
    return html.Div([
        html.Div([
            labelled("Compare with run", dropdown(OTHER, options=run_options,
                                                  placeholder="choose a second run")),
            html.Span(id="compare-what", className="hint"),
        ], className="toolbar card"),
        html.Div([
            html.Section([html.H2(id="compare-a-title"), html.Div(id="compare-a-table"),
                          chart("compare-a-values", 220)], className="card"),
            html.Section([html.H2(id="compare-b-title"), html.Div(id="compare-b-table"),
                          chart("compare-b-values", 220)], className="card"),
        ], className="compare-cols"),
        html.Section(chart("compare-over-steps", 280), className="card"),
    ], className="compare")


def _shown(data: list | None) -> tuple[dict | None, str]:
    """(the Graph tab's selection, its statistic) from the SEL store."""
    sel, statistic, _version = data or (None, None, None)
    return sel, statistic or "norm"


def register(app: dash.Dash, project: ProjectData) -> None:
    # the graph tab's clicks wake the compare callbacks only once this tab is shown
    gate(app, VALUE, SEL, (ids.SEL, "data"), (ids.STATISTIC, "value"),
         (ids.VERSION_SLOW, "data"))

    @app.callback(Output("compare-what", "children"), Input(SEL, "data"),
                  prevent_initial_call=True)
    def _what(shown: list | None) -> str:
        sel, statistic = _shown(shown)
        if not sel or not sel.get("tensor"):
            return "Select a tensor in the Graph tab."
        return (f"Same tensor, step and statistic in both runs: {sel['tensor']} "
                f"({sel['direction']}), {statistic} — choose them in the Graph tab.")

    for side in ("a", "b"):
        _register_column(app, project, side)

    @app.callback(Output("compare-over-steps", "figure"), Input(SEL, "data"),
                  Input(OTHER, "value"), prevent_initial_call=True)
    @figure_guard("over steps", 280)
    def _overlay(shown: list | None, other: str | None) -> dict:
        sel, statistic = _shown(shown)
        if not sel or not sel.get("tensor"):
            raise dash.exceptions.PreventUpdate
        return panels.history(project, [sel["run"], *([other] if other else [])], sel,
                              statistic, height=280)


def _register_column(app: dash.Dash, project: ProjectData, side: str) -> None:
    @app.callback(Output(f"compare-{side}-title", "children"),
                  Output(f"compare-{side}-table", "children"),
                  Output(f"compare-{side}-values", "figure"), Input(SEL, "data"),
                  Input(OTHER, "value"), prevent_initial_call=True)
    @guard(lambda msg: ("error", error_box(msg), dash.no_update))
    def _column(shown: list | None, other: str | None) -> tuple:
        sel, _statistic = _shown(shown)
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


TAB = Tab("Compare", VALUE, layout, register, run_lists=(OTHER,), stores=(SEL,))
