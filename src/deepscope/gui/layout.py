"""The page: header with the run selector, the tab strip, every tab's pane, page-level
stores, the poll.

Every selection lives in components and `dcc.Store`s in the browser, so two tabs of the same
browser (or two users) explore independently; the server keeps no selection state.

Every tab's pane stays mounted and the strip only hides the others (`pane-hidden`): a tab
switch then neither remounts a dozen charts nor asks the server anything (a hidden tab's
callbacks wait, see `tabs.gate`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import dash
from dash import Input, Output, dcc, html

from . import ids, poll, ranks
from .tabs import Tab
from .widgets import dropdown, labelled


def page(project_label: str, runs: list[str], tabs: Sequence[Tab]) -> html.Div:
    """The full GUI for a project with at least one run, its tabs in the order given."""
    run_options = [{"label": r, "value": r} for r in runs]
    return html.Div([
        html.Header([
            html.H1("deepscope", className="brand"),
            html.Span(project_label, className="project", title=project_label),
            labelled("Run", dropdown(ids.RUN, options=run_options, value=runs[0]), "run-ctl"),
            *ranks.header_controls(),
            html.Span(id=ids.LIVE_STATUS, className="live-status"),
        ], className="topbar"),
        dcc.Tabs(id=ids.TABS, value=tabs[0].value, className="tabs", children=[
            dcc.Tab(label=t.label, value=t.value) for t in tabs]),
        *[html.Div(t.layout(run_options), id=pane_id(t.value),
                   className=pane_class(t.value, tabs[0].value)) for t in tabs],
        *[dcc.Store(id=s, storage_type="memory") for t in tabs for s in t.stores],
        *poll.components(),
    ], className="app")


def pane_id(value: str) -> str:
    """The id of the div holding the content of the tab `value`."""
    return f"pane-{value}"


def pane_class(value: str, shown: str) -> str:
    """The pane of tab `value` while the tab `shown` is shown: hidden ones keep their size
    and drawn charts (no resize or redraw when shown again) but take no room."""
    return "pane" if value == shown else "pane pane-hidden"


def register_panes(app: dash.Dash, tabs: Sequence[Tab]) -> None:
    """Show the chosen tab's pane, hide the others; in the browser, no request."""
    values = [t.value for t in tabs]
    app.clientside_callback(
        f"function (shown) {{ return {json.dumps(values)}.map("
        "(v) => v === shown ? 'pane' : 'pane pane-hidden'); }",
        [Output(pane_id(v), "className") for v in values], Input(ids.TABS, "value"),
        prevent_initial_call=True)


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
        *poll.empty_components(),
    ], className="app")
