"""The Notes tab: the selected run's notes (scope.note), with their time and step.

Its callback runs only while the tab is shown, so the graph tab's clicks never pay for it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from dash import html

from ..data import RunData
from ..widgets import list_table
from . import run_card


def _notes(rd: RunData, run: str) -> Any:
    notes = rd.cached("notes", lambda r: r.notes())
    if notes.empty:
        return html.P(f"No notes in {run} (scope.note(text) adds one).", className="hint")
    return list_table(["time", "step", "note"], [
        [html.Td(_when(t)), html.Td("" if s is None or s != s else int(s)),
         html.Td(text, className="note-text")]
        for t, s, text in notes[["wall_time", "step", "text"]].itertuples(index=False)])


def _when(wall_time: float) -> str:
    return dt.datetime.fromtimestamp(wall_time).strftime("%Y-%m-%d %H:%M:%S")


TAB = run_card("Notes", "notes", "notes", _notes)
