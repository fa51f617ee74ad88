"""Small layout pieces every tab uses: labelled controls, dropdowns, charts, tables."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import dash
from dash import Input, Output, dcc, html

from . import ids

GRAPH_CONFIG = {"displaylogo": False, "responsive": True,
                "modeBarButtonsToRemove": ["lasso2d", "select2d"]}


def labelled(label: str, control: Any, cls: str = "") -> html.Div:
    """A control with its small label above it."""
    return html.Div([html.Label(label, className="ctl-label"), control],
                    className=f"ctl {cls}".strip())


def dropdown(id_: str, **kw: Any) -> dcc.Dropdown:
    """A dropdown that cannot be emptied unless asked (callbacks always get a value)."""
    kw.setdefault("clearable", False)
    return dcc.Dropdown(id=id_, options=kw.pop("options", []), **kw)


def chart(id_: str, height: int = 260) -> dcc.Graph:
    """A chart with a fixed height, so the page does not jump while figures arrive."""
    return dcc.Graph(id=id_, config=GRAPH_CONFIG, style={"height": f"{height}px"},
                     figure={"data": [], "layout": {"height": height}})


def chart_box(id_: str, height: int = 260) -> html.Div:
    """`chart(id_, height)` in a box of its height (id `<id_>-box`): the page does not jump
    while plotly draws, and `lazy_figures` can blank the chart while its figure waits."""
    return html.Div(chart(id_, height), id=f"{id_}-box", className="chart-box",
                    style={"height": f"{height}px"})


def lazy_figures(app: dash.Dash, store: str, view: str, charts: Sequence[str]) -> None:
    """The charts `charts` (each in a `chart_box`) take their figures from the store `store`
    ({chart id: figure}) in the browser (assets/app.js): those in the window at once, the
    others when scrolled near, their tab shown or the page printed (the store `view` changes
    then). A chart whose figure waits is blank, never the previous figure's numbers."""
    app.clientside_callback(
        "function (figures, _view, tab) { return window.deepscope.lazyFigures("
        f"{json.dumps(view)}, {json.dumps(list(charts))}, figures, tab); }}",
        [Output(c, "figure") for c in charts] + [Output(f"{c}-box", "className")
                                                 for c in charts],
        Input(store, "data"), Input(view, "data"), Input(ids.TABS, "value"),
        prevent_initial_call=True)


def list_table(headers: list[str], rows: list[list[Any]]) -> html.Table:
    """A plain table of cells (Notes and Diagnosis tabs)."""
    return html.Table([html.Thead(html.Tr([html.Th(h) for h in headers])),
                       html.Tbody([html.Tr(cells) for cells in rows])], className="list-table")
