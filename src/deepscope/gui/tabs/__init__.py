"""The GUI's tabs, one module each: its layout, its callbacks and the ids only it uses.

Each module exposes `TAB`, a `Tab`; the app shows them in the order of its `TABS` list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dash

from ..data import ProjectData

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


def only_on(tab: str, wanted: str) -> None:
    """Skip the callback unless the tab `wanted` is shown."""
    if tab != wanted:
        raise dash.exceptions.PreventUpdate
