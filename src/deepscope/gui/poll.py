"""Live updates for the whole page: a version token per run, polled every POLL_MS.

The page with runs polls `ids.VERSION` (new with every commit: the graph tab follows each
step) and `ids.VERSION_SLOW` (at most every SLOW_REFRESH_S: whole dashboards redraw on it),
and keeps every run list current; the page without runs reloads once a run appears.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import dash
from dash import Input, Output, State, dcc

from . import ids
from .data import ProjectData

POLL_MS = 2000
SLOW_REFRESH_S = 10.0  # dashboards (instruments, KPIs, ...) redraw at most this often


def components() -> list:
    """The poll's stores and interval, for the page with runs."""
    return [dcc.Store(id=ids.VERSION, storage_type="memory"),
            dcc.Store(id=ids.VERSION_SLOW, storage_type="memory"),
            dcc.Interval(id=ids.POLL, interval=POLL_MS)]


def empty_components() -> list:
    """The reload and its interval, for the page without runs."""
    return [dcc.Location(id=ids.LOCATION, refresh=True),
            dcc.Interval(id=ids.EMPTY_POLL, interval=POLL_MS)]


def register(app: dash.Dash, project: ProjectData, run_lists: Sequence[str]) -> None:
    """Both polls; `run_lists`: ids of the dropdowns whose options are the run names."""
    run_lists = tuple(run_lists)

    @app.callback(Output(ids.VERSION, "data"), Output(ids.VERSION_SLOW, "data"),
                  *[Output(i, "options") for i in run_lists],
                  Output(ids.LIVE_STATUS, "children"), Input(ids.POLL, "n_intervals"),
                  State(ids.VERSION, "data"), State(ids.VERSION_SLOW, "data"))
    def _poll(_n: int | None, known: dict[str, str] | None, slow: dict | None) -> tuple:
        """`version` changes with every commit; `version-slow` at most every
        SLOW_REFRESH_S, so that whole dashboards are not recomputed every poll while a run
        trains on the same machine."""
        versions = {name: project.run(name).version() for name in project.runs()}
        slow_due = slow is None or (slow["versions"] != versions and (
            time.time() - slow["time"] >= SLOW_REFRESH_S or list(slow["versions"]) !=
            list(versions)))
        if versions == known and not slow_due:
            raise dash.exceptions.PreventUpdate
        same_runs = known is not None and list(versions) == list(known)
        options = dash.no_update if same_runs else [{"label": r, "value": r}
                                                     for r in versions]
        status = f"updated {time.strftime('%H:%M:%S')}" if known is not None else "live"
        return (dash.no_update if versions == known else versions,
                {"versions": versions, "time": time.time()} if slow_due else dash.no_update,
                *[options] * len(run_lists), status)

    @app.callback(Output(ids.LOCATION, "href"), Input(ids.EMPTY_POLL, "n_intervals"))
    def _open_when_runs_appear(_n: int | None) -> str:
        if not project.runs():
            raise dash.exceptions.PreventUpdate
        return "/"
