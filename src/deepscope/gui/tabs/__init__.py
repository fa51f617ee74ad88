"""The GUI's tabs, one module each: its layout, its callbacks and the ids only it uses.

Each module exposes `TAB`, a `Tab`; the app shows them in the order of its `TABS` list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dash
from dash import Input, Output, html

from .. import ids
from ..data import ProjectData, RunData
from ..guard import contained, error_box

RunOptions = list[dict[str, str]]  # [{"label": run, "value": run}] in the project's order


@dataclass(frozen=True)
class Tab:
    """One tab of the page."""

    label: str                                        # shown on the tab strip
    value: str                                        # the tab strip's value while shown
    layout: Callable[[RunOptions], Any]               # the tab's content for the runs
    register: Callable[[dash.Dash, ProjectData], None]  # adds the tab's callbacks
    run_lists: tuple[str, ...] = ()  # dropdowns of run names the poll keeps current
    stores: tuple[str, ...] = ()     # memory stores, kept at page level across tab switches


def run_card(label: str, value: str, content: str,
             render: Callable[[RunData, str], Any]) -> Tab:
    """A tab that is one card, the div `content`: `render(run data, run name)` of the
    selected run, drawn while the tab is shown; an error shows in the card."""
    def layout(_run_options: RunOptions) -> html.Div:
        return html.Div(id=content, className="card")

    def register(app: dash.Dash, project: ProjectData) -> None:
        @app.callback(Output(content, "children"), Input(ids.TABS, "value"),
                      Input(ids.RUN, "value"), Input(ids.VERSION_SLOW, "data"))
        def _fill(tab: str, run: str | None, _v: Any) -> Any:
            if tab != value or not run:
                raise dash.exceptions.PreventUpdate
            return contained(lambda: render(project.run(run), run), error_box, render.__name__)

    return Tab(label, value, layout, register)
