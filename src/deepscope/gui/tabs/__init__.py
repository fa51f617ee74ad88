"""The GUI's tabs, one module each: its layout, its callbacks and the ids only it uses.

Each module exposes `TAB`, a `Tab`; the app shows them in the order of its `TABS` list.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dash
from dash import Input, Output, State, html

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


def gate(app: dash.Dash, value: str, store: str, *inputs: tuple[str, str]) -> None:
    """Copy the properties `inputs` ((component id, property) pairs) into the store `store`,
    as a list, while the tab `value` is shown and only when one of them changed.

    Every tab stays mounted (the page hides the others), so a tab's callbacks listen to its
    store instead of the page's selectors: a hidden tab neither asks the server nor redraws,
    catches up once when shown, and showing a tab whose content is current costs no request.
    Runs in the browser (no round trip).
    """
    app.clientside_callback(
        f"""function (tab, ...args) {{
            const known = args.pop();
            if (tab !== {json.dumps(value)} ||
                    JSON.stringify(args) === JSON.stringify(known)) {{
                return window.dash_clientside.no_update;
            }}
            return args;
        }}""",
        Output(store, "data"), Input(ids.TABS, "value"),
        *[Input(i, p) for i, p in inputs], State(store, "data"))


def run_card(label: str, value: str, content: str,
             render: Callable[[RunData, str], Any]) -> Tab:
    """A tab that is one card, the div `content`: `render(run data, run name)` of the
    selected run, drawn while the tab is shown (and again when shown after the run or its
    data changed); an error shows in the card."""
    shown = f"{content}-in"  # store: [run, slow version] of the shown content (`gate`)

    def layout(_run_options: RunOptions) -> html.Div:
        return html.Div(id=content, className="card")

    def register(app: dash.Dash, project: ProjectData) -> None:
        gate(app, value, shown, (ids.RUN, "value"), (ids.VERSION_SLOW, "data"))

        @app.callback(Output(content, "children"), Input(shown, "data"),
                      prevent_initial_call=True)
        def _fill(wanted: list | None) -> Any:
            run = (wanted or [None])[0]
            if not run:
                raise dash.exceptions.PreventUpdate
            return contained(lambda: render(project.run(run), run), error_box, render.__name__)

    return Tab(label, value, layout, register, stores=(shown,))
