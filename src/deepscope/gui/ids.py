"""Component ids that more than one module uses: the page, the poll and the tabs.

An id used by one tab only lives in that tab's module; these are the shared ones.
"""

from __future__ import annotations

from typing import Any

# the page
RUN = "run"                  # run selector in the header; every tab follows it
TABS = "tabs"                # the tab strip; its value is the shown tab's value
LIVE_STATUS = "live-status"  # "live" / "updated HH:MM:SS", set by the poll
GRAPH_TAB = "graph"          # the Graph tab's value (the Diagnosis tab switches to it)
# distributed runs (ranks.py): the rank selector in the header and what it knows of the run
RANK = "rank-choice"         # "global", "<r>" or "all"
RANK_INFO = "rank-info"      # None for a single-process run, else world, ranks, status line

# the poll (poll.py)
POLL = "poll"                  # interval of the page with runs
VERSION = "version"            # {run: version token}, new on every commit
VERSION_SLOW = "version-slow"  # the same at most every SLOW_REFRESH_S: dashboards redraw on it
EMPTY_POLL = "empty-poll"      # interval of the page without runs
LOCATION = "location"          # set by the empty page's poll once a run appears

# the Graph tab's selection, read by the Compare tab
SEL = "sel"                # the resolved selection (selection.Selection.as_dict())
STATISTIC = "statistic"    # statistic drawn over steps

# a Diagnosis row's button, which selects its step and tensor in the Graph tab
GO = "diag-go"  # pattern-matching id type


def go_id(step: int | None, where: str) -> dict[str, Any]:
    """The id of the button that selects `where` at `step` (-1: no step) in the graph tab."""
    return {"type": GO, "step": -1 if step is None else int(step), "where": where}


def picked(triggered_id: Any, triggered: list[dict[str, Any]]) -> tuple[str, int | None] | None:
    """(tensor, step) when a diagnosis button was really clicked (not just drawn)."""
    if not (isinstance(triggered_id, dict) and triggered_id.get("type") == GO):
        return None
    if not any(t.get("value") for t in triggered):
        return None
    step = int(triggered_id["step"])
    return str(triggered_id["where"]), (None if step < 0 else step)
