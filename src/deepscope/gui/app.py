"""`create_app(project_path)`: the Dash application for one project folder."""

from __future__ import annotations

from pathlib import Path

import dash
from dash import html

from . import ids, poll, ranks
from .data import ProjectData
from .layout import empty_page, page, register_panes
from .tabs import Tab, compare, diagnosis, graph, instruments, kpis, notes

ASSETS = Path(__file__).with_name("assets")
# The tabs, in the order shown; the first is open on load.
TABS: tuple[Tab, ...] = (graph.TAB, instruments.TAB, kpis.TAB, compare.TAB, notes.TAB,
                         diagnosis.TAB)


def create_app(project_path: str | Path) -> dash.Dash:
    """A Dash app serving the runs in `project_path` (a project folder or one run folder).

    Every script and stylesheet is served by this app itself (nothing from a CDN). The page
    is built per load, so runs written after start-up are found; a folder without runs shows
    a page that says so and opens the runs once the first one is written.
    """
    project = ProjectData(project_path)
    app = dash.Dash(
        __name__, title="deepscope", assets_folder=str(ASSETS), serve_locally=True,
        external_stylesheets=[], external_scripts=[], suppress_callback_exceptions=True,
        update_title=None, enable_mcp=False)
    label = str(project.path.resolve())

    def layout() -> html.Div:
        if not project.exists():
            return empty_page(label, f"The folder {label} does not exist.")
        runs = project.runs()
        if not runs:
            return empty_page(label, f"No runs in {label} yet.")
        return page(label, runs, TABS)

    app.layout = layout
    # Callbacks refer to components of both pages; validate them against both.
    app.validation_layout = html.Div([page(label, ["run"], TABS), empty_page(label, "")])
    poll.register(app, project, (ids.RUN, *(i for t in TABS for i in t.run_lists)))
    register_panes(app, TABS)
    for tab in TABS:
        tab.register(app, project)
    ranks.register(app, project)
    return app
