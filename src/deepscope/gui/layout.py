"""The page: header with the run selector, the tab strip, page-level stores, the poll.

Every selection lives in components and `dcc.Store`s in the browser, so two tabs of the same
browser (or two users) explore independently; the server keeps no selection state.
"""

from __future__ import annotations

from collections.abc import Sequence

from dash import dcc, html

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
            dcc.Tab(label=t.label, value=t.value, children=t.layout(run_options))
            for t in tabs]),
        *[dcc.Store(id=s, storage_type="memory") for t in tabs for s in t.stores],
        *poll.components(),
    ], className="app")


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
