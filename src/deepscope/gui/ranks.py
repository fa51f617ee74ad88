"""Distributed runs in the GUI: the rank selector, the per-rank spread strip, the ranks'
status line and the warning when the ranks' graphs differ.

Everything here is hidden for single-process runs and costs them nothing but one light
request when the run changes: the strip and the graph check are woken by browser-side gates
that pass only while the selected run has more than one rank.

The rank selector's values: "global" (the global batch: instrument values of the global
batch, tensor statistics merged over ranks), "<r>" (rank r's own micro-batch), "all" (one
trace per rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import dash
import numpy as np
import pandas as pd
from dash import Input, Output, State, dcc, html

from ..store.schema import STAT_COLUMNS
from . import ids
from .data import ProjectData, RunData, fingerprint
from .figures import Figure, base_layout, line_trace, message_figure
from .guard import contained, error_box, error_figure
from .widgets import chart, dropdown, labelled

GLOBAL = "global"
ALL = "all"
QueryRank = str | int  # what `run.stats(rank=)` takes: "merged", a rank, or "all"

# the spread strip: local values every rank writes (layer "": the whole model; GradNorm
# also per parameter, drawn for the Instruments tab's layer)
STRIP = (("Loss", "local loss", "rank-loss"), ("GradNorm", "local gradient norm",
                                               "rank-gradnorm"))
STRIP_HEIGHT = 220
GLOBAL_COLOUR = "#000000"
STANDS_OUT = 2.0  # the outlier's mean distance from the median, at least this × the next's


# --- what a run's ranks are -------------------------------------------------------------
def rank_info(rd: RunData) -> dict[str, Any] | None:
    """{"world", "ranks", "status", "detail", "bad"} of a distributed run, None for a
    single-process run (world size 1): what the header shows and the gates read."""
    if rd.world_size() <= 1:
        return None

    def build(run: Any) -> dict[str, Any]:
        line, detail, bad = status_line(run.rank_status(), run.world_size)
        return {"world": run.world_size, "ranks": [int(r) for r in run.ranks],
                "status": line, "detail": detail, "bad": bad}
    return rd.cached("rank_info", build)


def status_line(table: pd.DataFrame, world: int) -> tuple[str, str, bool]:
    """One short line on the ranks (from `run.rank_status()`): how many, and each rank that
    is missing, crashed, interrupted, left out or otherwise not right; the same with each
    rank's problem spelled out (the line's tooltip); and whether any rank is not right."""
    short, long = [], []
    for row in table.itertuples(index=False):
        if row.status in ("finished", "recording") and not _text(row.problem):
            continue
        text = f"rank {int(row.rank)} {row.status}"
        if row.status != "missing" and _number(row.last_step) is not None:
            text += f" after step {int(row.last_step)}"
        short.append(text)
        long.append(text + (f": {_text(row.problem)}" if _text(row.problem) else ""))
    head = f"{world} ranks"
    if not short:
        return head, head, False
    return head + " · " + "; ".join(short), head + "\n" + "\n".join(long), True


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float, np.number)) and math.isfinite(v) else None


def query_rank(rd: RunData, choice: str | None) -> QueryRank | None:
    """The `rank=` argument of the query API for the selector's value, or None for a
    single-process run (its queries stay as they are)."""
    if rd.world_size() <= 1:
        return None
    if choice in (None, GLOBAL):
        return "merged"
    if choice == ALL:
        return ALL
    return int(choice)


def rank_label(rank: QueryRank) -> str:
    """How a query rank is named in titles and legends."""
    return {"merged": "global batch (ranks merged)", ALL: "all ranks"}.get(str(rank),
                                                                           f"rank {rank}")


def merged_gap(rd: RunData, values: pd.DataFrame, rank: QueryRank | None) -> str:
    """Why some merged statistics in `values` (columns of `STAT_COLUMNS`) are missing, or
    "": a statistic of the global batch needs every rank's record (a missing rank, or one
    that did not record the tensor, leaves it NaN), and sv_max is never merged."""
    if rank != "merged":
        return ""
    info = rank_info(rd) or {"world": 1, "ranks": [0]}
    parts = []
    stats = [c for c in STAT_COLUMNS if c in values and c != "sv_max"]
    if stats and values[stats].isna().to_numpy().any():
        absent = [r for r in range(info["world"]) if r not in info["ranks"]]
        parts.append("some merged values are missing: a rank has no record"
                     + (f" (rank {', '.join(map(str, absent))} has no file)" if absent else "")
                     + " or no finite element; choose a rank to see its own")
    if "sv_max" in values and values["sv_max"].isna().all():
        parts.append("sv_max is not merged over ranks")
    return "; ".join(parts)


def unbatched_note(rd: RunData, tensor: str, every: Any) -> str:
    """The merged record of a tensor without a batch dimension (a parameter, a synced
    gradient, a scalar loss) is the lowest rank's, since it should be the same on every rank:
    "" where it is (or the tensor has a batch dimension), else a note that the ranks' records
    differ, so the merged value is one rank's. every: a callable giving the tensor's records
    with rank="all" (read only for such a tensor)."""
    if rd.tensor_info().get(tensor, {}).get("batch_dim") is not None:
        return ""
    table = every()
    table = table[table["tensor"] == tensor] if "tensor" in table else table
    cols = [c for c in STAT_COLUMNS if c in table and c != "sv_max"]
    keys = [c for c in ("step", "iteration", "direction") if c in table]
    for _, g in table.groupby(keys, sort=False):
        values = g[cols].to_numpy(dtype=float)
        same = (values == values[0]) | (np.isnan(values) & np.isnan(values[0]))
        if not same.all():
            lowest = (rank_info(rd) or {"ranks": [0]})["ranks"][0]
            return (f"{tensor} has no batch dimension and the ranks' records differ: this is "
                    f"rank {lowest}'s; choose all ranks to compare")
    return ""


def distinct_warnings(table: pd.DataFrame, present: list[int]) -> pd.DataFrame:
    """A several-rank `run.warnings()` table (a `rank` column first) as a one-rank one: each
    distinct warning once, at its first step, its location prefixed with the ranks that had
    it unless all `present` ranks did."""
    rows = []
    for (location, message), g in table.groupby(["location", "message"], sort=False):
        had = sorted(int(r) for r in set(g["rank"]))
        if had != sorted(present):
            who = f"rank{'s' if len(had) > 1 else ''} {', '.join(map(str, had))}"
            location = f"{who} · {location}" if location else who
        first = g.iloc[0]
        rows.append((g["step"].min(), location, first["quantities"], message))
    return pd.DataFrame(rows, columns=["step", "location", "quantities", "message"])


def split_ranks(df: pd.DataFrame, rank: QueryRank) -> list[tuple[str, pd.DataFrame]]:
    """(" · rank k", its rows) per rank of a rank="all" table; the table whole otherwise."""
    if rank != ALL:
        return [("" if rank == "merged" else f" · rank {rank}", df)]
    return [(f" · rank {int(k)}", g.drop(columns="rank"))
            for k, g in df.groupby("rank", sort=True)]


def graph_mismatch(rd: RunData, step: int, iteration: int) -> list[int]:
    """Ranks whose dependency graph at (step, iteration) differs from rank 0's (which the
    Graph tab shows); a rank that did not record the step is not compared."""
    info = rank_info(rd)
    if info is None:
        return []
    shown = fingerprint(rd.graph(step, iteration))

    def build(run: Any) -> list[int]:
        out = []
        for r in info["ranks"]:
            if r == 0 or step not in run.steps(rank=r):
                continue
            if fingerprint(run.graph(step, iteration=iteration, rank=r)) != shown:
                out.append(r)
        return out
    return rd.cached(f"graph_mismatch:{step}:{iteration}", build)


# --- the spread strip ---------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """One local quantity over steps, one series per rank, and which rank stands out."""

    table: pd.DataFrame       # index step, one column per rank (NaN where a rank lacks it)
    outlier: int | None       # the rank furthest from the per-step median (3+ ranks)
    summary: str              # one line saying so (or how far the two ranks are apart)


def spread(local: pd.DataFrame, name: str, layer: str = "") -> Spread:
    """The spread of local quantity `name` of `layer` ("" = the whole model) over ranks,
    from `run.quantities(rank="all")`.

    Distance from the median is relative, |v − median| / |median| per step (absolute where
    the median is 0), averaged over the steps a rank has; with 3 or more ranks the rank with
    the largest average is the outlier if it is STANDS_OUT times the next one's. With 2
    ranks the median is their midpoint, so no rank can be singled out: the summary gives
    their largest relative gap instead.
    """
    rows = local[(local["name"] == name) & (local["layer"] == layer)]
    # one value per rank and step (the tables' key): a plain pivot, no aggregation
    table = rows.pivot(index="step", columns="rank", values="value").sort_index()
    table.columns = [int(c) for c in table.columns]
    if table.shape[1] < 2 or table.empty:
        return Spread(table, None, "")
    values = table.to_numpy(dtype=float)
    with np.errstate(all="ignore"):
        median = np.nanmedian(values, axis=1, keepdims=True)
        scale = np.where(np.abs(median) > 0, np.abs(median), 1.0)
        dev = np.abs(values - median) / scale
    if not np.isfinite(dev).any():
        return Spread(table, None, "")
    if table.shape[1] == 2:
        gap = np.abs(values[:, 0] - values[:, 1]) / (2 * scale[:, 0])
        i = int(np.nanargmax(gap))
        hi = table.columns[int(np.nanargmax(values[i]))]
        return Spread(table, None, f"ranks {table.columns[0]} and {table.columns[1]} differ by "
                                   f"up to {2 * gap[i]:.0%} of their mean (step "
                                   f"{table.index[i]}, rank {hi} higher)")
    with np.errstate(all="ignore"):
        score = np.nanmean(dev, axis=0)
    k = int(np.nanargmax(score))
    second = np.sort(np.where(np.isfinite(score), score, -np.inf))[-2]
    if not score[k] > STANDS_OUT * max(second, 0.0):
        return Spread(table, None, f"no rank stands out (each is at most {score[k]:.0%} "
                                   "from the median on average)")
    worst = int(np.nanargmax(dev[:, k]))
    rank = table.columns[k]
    return Spread(table, rank, f"rank {rank} is furthest from the median: {score[k]:.0%} off "
                               f"on average, {dev[worst, k]:.0%} at step {table.index[worst]}")


def strip_figure(rd: RunData, name: str, title: str, local: pd.DataFrame,
                 choice: str | None, layer: str = "") -> tuple[Figure, Spread]:
    """One chart of the strip: every rank's local value over steps (the outlier bold, a
    chosen rank bold and the others faint), the global batch's value dashed; and the
    spread it shows. layer: the Instruments tab's layer, where the ranks recorded `name`
    for it (else the whole model)."""
    if layer and not ((local["name"] == name) & (local["layer"] == layer)).any():
        layer = ""
    title += f" · {layer}" if layer else ""
    s = spread(local, name, layer)
    if s.table.empty:
        return message_figure(f"{name}: no local values recorded", title,
                              height=STRIP_HEIGHT), s
    chosen = int(choice) if choice not in (None, GLOBAL, ALL) else None
    traces = []
    for k in s.table.columns:
        label = f"rank {k}" + (" (furthest from median)" if k == s.outlier else "")
        trace = line_trace(label, s.table.index, s.table[k], k)
        if k == chosen or (chosen is None and k == s.outlier):
            trace["line"]["width"] = 3.2
        elif chosen is not None:
            trace["opacity"] = 0.3
        traces.append(trace)
    glob = rd.quantities(name)
    glob = glob[glob["layer"] == layer]
    if not glob.empty:
        trace = line_trace("global batch", glob["step"], glob["value"], dash="dash")
        trace["line"]["color"] = GLOBAL_COLOUR
        traces.append(trace)
    layout = base_layout(title, height=STRIP_HEIGHT, showlegend=True,
                         meta={"quantity": name, "layer": layer, "outlier": s.outlier,
                               "ranks": [int(k) for k in s.table.columns], "chosen": chosen})
    return {"data": traces, "layout": layout}, s


def strip_panels(rd: RunData, choice: str | None,
                 layer: str = "") -> tuple[list[Figure], list[Any]]:
    """The strip's figures and its summary lines (one per quantity that has one); the
    gradient norm of `layer` where the ranks recorded it per layer."""
    local = rd.cached("local_values", lambda r: pd.concat(
        [r.quantities(n, rank=ALL) for n, _, _ in STRIP], ignore_index=True))
    figures, lines = [], []
    for name, title, _ in STRIP:
        figure, s = strip_figure(rd, name, title, local, choice,
                                 layer if name == "GradNorm" else "")
        figures.append(figure)
        if s.summary:  # a rank that stands out is a warning; the plain spread a remark
            bad = s.outlier is not None
            lines.append(html.P(("⚠ " if bad else "") + f"{title}: {s.summary}",
                                className="rank-outlier" if bad else "hint"))
    return figures, lines


# --- layout -------------------------------------------------------------------------------
HIDDEN = {"display": "none"}


def header_controls() -> list[Any]:
    """The header's rank selector and status line, hidden until a distributed run is shown,
    and the store the gates read."""
    return [html.Div(labelled("Rank", dropdown(ids.RANK, value=GLOBAL, options=[GLOBAL]),
                              "run-ctl rank-ctl"), id="rank-ctl", style=HIDDEN),
            html.Span(id="rank-status", className="rank-status"),
            dcc.Store(id=ids.RANK_INFO, storage_type="memory"),
            dcc.Store(id="rank-strip-key", storage_type="memory"),
            dcc.Store(id="rank-graph-key", storage_type="memory")]


def strip() -> html.Section:
    """The Instruments tab's per-rank spread strip (hidden for single-process runs)."""
    return html.Section([
        html.H2("Ranks: local values of each rank's micro-batch"),
        html.P("Each rank's own loss and gradient norm (before the gradient all-reduce); "
               "the panels below show the global batch.", className="hint"),
        html.Div(id="rank-strip-summary", className="rank-summary"),
        html.Div([chart(cid, STRIP_HEIGHT) for _, _, cid in STRIP], className="panel-grid"),
    ], id="rank-strip", className="card", style=HIDDEN)


def graph_warning() -> html.Div:
    """Under the graph: says when other ranks recorded another graph than rank 0's."""
    return html.Div(id="rank-graph-warning")


def rank_options(info: dict[str, Any]) -> list[dict[str, str]]:
    return ([{"label": "global batch", "value": GLOBAL}]
            + [{"label": f"rank {r}", "value": str(r)} for r in info["ranks"]]
            + [{"label": "all ranks", "value": ALL}])


# --- callbacks ----------------------------------------------------------------------------
# Browser-side gates: the strip and the graph check wake the server only for a distributed
# run (rank-info set) and only when what they show changed.
_STRIP_GATE = """function (tab, info, rank, version, layer, known) {
    const run = info && info.run;
    const key = (tab === "instruments" && run) ? [run, rank,
        ((version || {}).versions || {})[run] || null, layer || ""] : null;
    if (!key || JSON.stringify(key) === JSON.stringify(known)) {
        return window.dash_clientside.no_update;
    }
    return key;
}"""
_GRAPH_GATE = """function (sel, info, known) {
    const key = (info && sel && !sel.empty && sel.run === info.run && sel.step !== null)
        ? [sel.run, sel.step, sel.iteration] : null;
    if (JSON.stringify(key) === JSON.stringify(known)) {
        return window.dash_clientside.no_update;
    }
    return key;
}"""


def register(app: dash.Dash, project: ProjectData) -> None:
    """The rank selector's, the strip's and the graph warning's callbacks."""
    @app.callback(Output(ids.RANK_INFO, "data"), Output("rank-ctl", "style"),
                  Output(ids.RANK, "options"), Output(ids.RANK, "value"),
                  Output("rank-status", "children"), Output("rank-status", "title"),
                  Output("rank-status", "className"), Output("rank-strip", "style"),
                  Input(ids.RUN, "value"),
                  Input(ids.VERSION_SLOW, "data"), State(ids.RANK, "value"),
                  State(ids.RANK_INFO, "data"))
    def _info(run: str | None, _v: Any, rank: str | None, known: dict | None) -> tuple:
        info = contained(lambda: rank_info(project.run(run)) if run else None,
                         lambda msg: {"world": 0, "ranks": [], "status": f"ranks: {msg}",
                                      "detail": msg, "bad": True}, "ranks")
        if info is None:
            if known is None:
                raise dash.exceptions.PreventUpdate  # single-process run after another
            return None, HIDDEN, [GLOBAL], GLOBAL, "", "", "rank-status", HIDDEN
        info = {**info, "run": run}
        if info == known:
            raise dash.exceptions.PreventUpdate
        options = rank_options(info)
        value = rank if rank in {o["value"] for o in options} else GLOBAL
        return (info, {}, options, value, info["status"], info["detail"],
                "rank-status bad" if info["bad"] else "rank-status", {})

    app.clientside_callback(_STRIP_GATE, Output("rank-strip-key", "data"),
                            Input(ids.TABS, "value"), Input(ids.RANK_INFO, "data"),
                            Input(ids.RANK, "value"), Input(ids.VERSION_SLOW, "data"),
                            Input("inst-layer", "value"), State("rank-strip-key", "data"))
    app.clientside_callback(_GRAPH_GATE, Output("rank-graph-key", "data"),
                            Input(ids.SEL, "data"), Input(ids.RANK_INFO, "data"),
                            State("rank-graph-key", "data"))

    @app.callback(*[Output(cid, "figure") for _, _, cid in STRIP],
                  Output("rank-strip-summary", "children"), Input("rank-strip-key", "data"))
    def _strip(key: list | None) -> tuple:
        if not key:
            raise dash.exceptions.PreventUpdate
        run, rank, _version, layer = key

        def failed(msg: str) -> tuple:
            return (*[error_figure(msg, title, STRIP_HEIGHT) for _, title, _ in STRIP],
                    error_box(msg))
        return contained(lambda: _strip_outputs(project.run(run), rank, layer), failed,
                         "rank strip")

    @app.callback(Output("rank-graph-warning", "children"), Input("rank-graph-key", "data"))
    def _graph_warning(key: list | None) -> Any:
        if not key:
            return None
        run, step, iteration = key
        return contained(lambda: _graph_banner(project.run(run), step, iteration),
                         error_box, "graph comparison")


def _strip_outputs(rd: RunData, rank: str | None, layer: str) -> tuple:
    figures, lines = strip_panels(rd, rank, layer)
    return (*figures, lines)


def _graph_banner(rd: RunData, step: int, iteration: int) -> Any:
    differ = graph_mismatch(rd, step, iteration)
    if not differ:
        return None
    names = ", ".join(f"rank {r}" for r in differ)
    return html.Div(f"⚠ the graph shown is rank 0's; {names} recorded a different graph at "
                    f"step {step}" + (f", iteration {iteration}" if iteration else "")
                    + " (other tensors or dependencies: the ranks ran different code)",
                    className="banner-bad", role="alert", **{"data-ranks": names})
