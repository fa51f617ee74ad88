"""The page: header, tabs (graph explorer, instruments, KPIs, compare, notes, anomalies).

Every selection lives in components and `dcc.Store`s in the browser, so two tabs of the same
browser (or two users) explore independently; the server keeps no selection state.
"""

from __future__ import annotations

from typing import Any

import dash_cytoscape as cyto
from dash import dcc, html

from ..store.schema import STAT_COLUMNS
from . import graph_view
from .instruments import PANELS, PER_LAYER, SECTIONS

POLL_MS = 2000
GRAPH_CONFIG = {"displaylogo": False, "responsive": True,
                "modeBarButtonsToRemove": ["lasso2d", "select2d"]}
STATISTICS = [s for s in STAT_COLUMNS if s != "numel"]
COLOUR_OPTIONS = ([{"label": "role", "value": "role"}]
                  + [{"label": f"statistic: {s}", "value": f"stat:{s}"} for s in STATISTICS]
                  + [{"label": f"quantity: {q}", "value": f"q:{q}"} for q in PER_LAYER])


def _labelled(label: str, control: Any, cls: str = "") -> html.Div:
    """A control with its small label above it."""
    return html.Div([html.Label(label, className="ctl-label"), control],
                    className=f"ctl {cls}".strip())


def _dropdown(id_: str, **kw: Any) -> dcc.Dropdown:
    """A dropdown that cannot be emptied unless asked (callbacks always get a value)."""
    kw.setdefault("clearable", False)
    return dcc.Dropdown(id=id_, options=kw.pop("options", []), **kw)


def _graph(id_: str, height: int = 260) -> dcc.Graph:
    """A chart with a fixed height, so the page does not jump while figures arrive."""
    return dcc.Graph(id=id_, config=GRAPH_CONFIG, style={"height": f"{height}px"},
                     figure={"data": [], "layout": {"height": height}})


def page(project_label: str, runs: list[str]) -> html.Div:
    """The full GUI for a project with at least one run."""
    run_options = [{"label": r, "value": r} for r in runs]
    return html.Div([
        html.Header([
            html.H1("deepscope", className="brand"),
            html.Span(project_label, className="project", title=project_label),
            _labelled("Run", _dropdown("run", options=run_options, value=runs[0]), "run-ctl"),
            html.Span(id="live-status", className="live-status"),
        ], className="topbar"),
        dcc.Tabs(id="tabs", value="graph", className="tabs", children=[
            dcc.Tab(label="Graph", value="graph", children=explorer_tab()),
            dcc.Tab(label="Instruments", value="instruments", children=instruments_tab()),
            dcc.Tab(label="KPIs", value="kpis", children=kpis_tab(run_options)),
            dcc.Tab(label="Compare", value="compare", children=compare_tab(run_options)),
            dcc.Tab(label="Notes", value="notes", children=html.Div(id="notes",
                                                                     className="card")),
            dcc.Tab(label="Diagnosis", value="anomalies",
                    children=html.Div(id="anomalies", className="card")),
        ]),
        dcc.Store(id="sel", storage_type="memory"),
        dcc.Store(id="sel-compare", storage_type="memory"),
        dcc.Store(id="version", storage_type="memory"),
        dcc.Store(id="version-slow", storage_type="memory"),
        dcc.Store(id="graph-key", storage_type="memory"),
        dcc.Store(id="over-steps-key", storage_type="memory"),
        dcc.Store(id="controls-sent", storage_type="memory"),
        dcc.Interval(id="poll", interval=POLL_MS),
    ], className="app")


def explorer_tab() -> html.Div:
    """Graph and selectors on the left, the selected record's outputs on the right."""
    graph_card = html.Section([
        html.Div([
            _labelled("Kind", _dropdown("kind")),
            _labelled("Iteration", _dropdown("iteration")),
            _labelled("Colour by", _dropdown("colour-by", options=COLOUR_OPTIONS, value="role")),
            dcc.Checklist(id="colour-shared", value=["shared"], className="radio",
                          options=[{"label": "one scale for all runs", "value": "shared"}]),
        ], className="toolbar"),
        cyto.Cytoscape(
            id="graph", elements=[], stylesheet=graph_view.stylesheet(),
            layout={"name": "preset", "fit": True, "padding": 24},
            style={"width": "100%", "height": "46vh"}, minZoom=0.1, maxZoom=3,
            autoRefreshLayout=False, autounselectify=True, responsive=True,
            className="graph"),
        html.Div(id="legend", className="legend"),
        html.Details([html.Summary("All nodes (keyboard access)"),
                      html.Div(id="node-list", className="node-list")],
                     className="node-list-wrap"),
    ], className="card graph-card")
    selectors = html.Section([
        html.Div([
            html.Button("◀", id="step-prev", className="step-btn", title="previous step (←)"),
            html.Div(dcc.Slider(id="step-slider", min=0, max=0, step=1, value=0, marks={},
                                updatemode="mouseup", allow_direct_input=False),
                     className="slider-wrap"),
            html.Button("▶", id="step-next", className="step-btn", title="next step (→)"),
            html.Span(id="step-label", className="step-label"),
        ], className="step-row"),
        html.Div([
            _labelled("Node", _dropdown("node", searchable=True)),
            _labelled("Tensor (role in node)", _dropdown("tensor")),
            _labelled("Batch view", _dropdown("batch")),
            _labelled("Values", dcc.RadioItems(id="direction", options=[], inline=True,
                                               className="radio")),
        ], className="selector-grid"),
    ], className="card selectors")
    output = html.Section([
        html.Div(id="nonfinite-banner"),
        html.Div(id="stats-table", className="stats-table"),
        _graph("values-chart", 240),
        _graph("items-chart", 200),
        html.Div([
            _labelled("Statistic over steps", _dropdown(
                "statistic", options=STATISTICS, value="norm")),
            _labelled("Overlay runs", _dropdown("overlay", multi=True, clearable=True,
                                                placeholder="add runs to compare")),
        ], className="toolbar"),
        _graph("over-steps", 260),
    ], className="card output")
    return html.Div([html.Div([graph_card, selectors], className="col-left"),
                     html.Div(output, className="col-right")], className="explorer")


def instruments_tab() -> html.Div:
    """The Cockpit-like dashboard: one chart per panel, grouped in sections."""
    sections = []
    for i, (title, keys) in enumerate(SECTIONS):
        sections.append(html.Section([
            html.H2(title),
            html.Div(id=f"inst-warnings-{i}", className="inst-warnings"),  # beside the charts
            html.Div([_graph(f"inst-{k}", PANELS[k].height) for k in keys],
                     className="panel-grid"),
        ], className="card"))
    return html.Div([
        html.Div([_labelled("Layer", _dropdown("inst-layer", value="")),
                  html.Span("Per-layer values where the instrument records them; "
                            "a quantity the run did not record says 'not tracked'.",
                            className="hint")], className="toolbar card"),
        *sections,
    ], className="instruments")


def kpis_tab(run_options: list[dict[str, str]]) -> html.Div:
    """KPIs of the chosen runs overlaid, with exponential smoothing."""
    return html.Div([
        html.Div([
            _labelled("Runs", _dropdown("kpi-runs", options=run_options, multi=True,
                                        value=[o["value"] for o in run_options])),
            _labelled("Smoothing", dcc.Slider(id="kpi-smooth", min=0, max=0.99, step=0.01,
                                              value=0.6, marks={0: "0", 0.6: "0.6",
                                                                0.99: "0.99"},
                                              allow_direct_input=False), "smooth-ctl"),
        ], className="toolbar card"),
        html.Div(id="kpi-charts", className="panel-grid"),
    ], className="kpis")


def compare_tab(run_options: list[dict[str, str]]) -> html.Div:
    """The selected record in two runs side by side, and both histories in one chart."""
    return html.Div([
        html.Div([
            _labelled("Compare with run", _dropdown("compare-b", options=run_options,
                                                    placeholder="choose a second run")),
            html.Span(id="compare-what", className="hint"),
        ], className="toolbar card"),
        html.Div([
            html.Section([html.H2(id="compare-a-title"), html.Div(id="compare-a-table"),
                          _graph("compare-a-values", 220)], className="card"),
            html.Section([html.H2(id="compare-b-title"), html.Div(id="compare-b-table"),
                          _graph("compare-b-values", 220)], className="card"),
        ], className="compare-cols"),
        html.Section(_graph("compare-over-steps", 280), className="card"),
    ], className="compare")


def empty_page(path: str, reason: str) -> html.Div:
    """Shown when the folder is missing or holds no runs; it reloads once runs appear."""
    return html.Div([
        html.Header([html.H1("deepscope", className="brand"),
                     html.Span(path, className="project")], className="topbar"),
        html.Main([
            html.H2(reason, id="empty-reason"),
            html.P(["Record a run into this folder, for example:"]),
            html.Pre("scope = deepscope.Scope(" + repr(path) + ", run=\"baseline\")\n"
                     "with scope.step(step) as rec:\n    ...\nscope.close()"),
            html.P("This page opens the runs by itself as soon as one is written."),
        ], className="card empty"),
        dcc.Location(id="location", refresh=True),
        dcc.Interval(id="empty-poll", interval=POLL_MS),
    ], className="app")
