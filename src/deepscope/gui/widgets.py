"""Small layout pieces every tab uses: labelled controls, dropdowns, charts, tables."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import dash
from dash import Input, Output, dcc, html

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


def store_figures(app: dash.Dash, store: str, charts: Sequence[str]) -> None:
    """The charts `charts` take their figures from the store `store` ({chart id: figure}) in
    the browser (assets/app.js): one server answer updates them all."""
    app.clientside_callback(
        "function (figures) { return window.deepscope.figuresOf("
        f"{json.dumps(list(charts))}, figures); }}",
        [Output(c, "figure") for c in charts], Input(store, "data"), prevent_initial_call=True)


def list_table(headers: list[str], rows: list[list[Any]]) -> html.Table:
    """A plain table of cells (Notes and Diagnosis tabs)."""
    return html.Table([html.Thead(html.Tr([html.Th(h) for h in headers])),
                       html.Tbody([html.Tr(cells) for cells in rows])], className="list-table")
