"""The Notes tab: the selected run's notes (scope.note), newest last.

Its callback runs only while the tab is shown, so the graph tab's clicks never pay for it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import dash
from dash import Input, Output, html

from .. import ids
from ..data import ProjectData
from ..guard import error_box, guard
from ..widgets import list_table
from . import Tab, only_on

VALUE = "notes"
CONTENT = "notes"  # the tab's content div


def layout(_run_options: list[dict[str, str]]) -> html.Div:
    return html.Div(id=CONTENT, className="card")


def register(app: dash.Dash, project: ProjectData) -> None:
    @app.callback(Output(CONTENT, "children"), Input(ids.TABS, "value"),
                  Input(ids.RUN, "value"), Input(ids.VERSION_SLOW, "data"))
    @guard(lambda msg: error_box(msg))
    def _notes(tab: str, run: str | None, _v: Any) -> Any:
        only_on(tab, VALUE)
        if not run:
            raise dash.exceptions.PreventUpdate
        notes = project.run(run).cached("notes", lambda r: r.notes())
        if notes.empty:
            return html.P(f"No notes in {run} (scope.note(text) adds one).", className="hint")
        return list_table(["time", "step", "note"], [
            [html.Td(_when(t)), html.Td("" if s is None or s != s else int(s)),
             html.Td(text, className="note-text")]
            for t, s, text in notes[["wall_time", "step", "text"]].itertuples(index=False)])


def _when(wall_time: float) -> str:
    return dt.datetime.fromtimestamp(wall_time).strftime("%Y-%m-%d %H:%M:%S")


TAB = Tab("Notes", VALUE, layout, register)
