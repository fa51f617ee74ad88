"""Output panels of one tensor record: statistics table, values, per-item values, history.

Each function reads only what it shows (one or two small queries) from a `RunData`; the graph
tab and the compare tab share them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from dash import html

from ..store.schema import SAMPLE_MAX_VALUES, STAT_COLUMNS
from . import ranks
from .data import ProjectData, RunData
from .figures import (
    Figure,
    base_layout,
    integer_axis,
    line_trace,
    message_figure,
    note,
    step_marker,
    values_figure,
)
from .selection import BATCH_VIEWS

NONFINITE = ("nan", "posinf", "neginf")


def fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if float(v).is_integer() and abs(v) < 1e15:
        return f"{int(v):d}"
    return f"{v:.5g}"


def stats_table(rd: RunData, sel: dict[str, Any], rank: str | None = None) -> tuple[Any, Any]:
    """(banner, table) for the selected tensor record; one column per stored direction, plus
    one for the selected batch item (computed from its stored values) when a sample is shown.
    rank: the rank selector's value, for a distributed run (default: the global batch,
    merged); "all": one column per rank, of the selected direction."""
    tensor, step, it = sel["tensor"], sel["step"], sel["record_iteration"]
    q = ranks.query_rank(rd, rank)
    df = rd.step_records(step) if q is None else rd.step_records(step, q)
    df = df[(df["tensor"] == tensor) & (df["iteration"] == it)]
    if q == ranks.ALL:
        df = df[df["direction"] == sel["direction"]]
    if df.empty:
        return None, html.P(f"{tensor} has no record at step {step}, iteration {it}.",
                            className="hint")
    # (header, stored direction, statistics, selected) per column
    heads = ([f"rank {int(k)}" for k in df["rank"]] if q == ranks.ALL
             else [_direction_name(d) for d in df["direction"]])
    columns = [(h, d, row[list(STAT_COLUMNS)].astype(float).tolist(),
                d == sel["direction"] and q != ranks.ALL)
               for h, d, (_, row) in zip(heads, df["direction"], df.iterrows())]
    item, why_not = _item_stats(rd, sel, q)
    caption = f"{tensor} · step {step}" + (f" · iteration {it}" if it else "")
    if q is not None:
        caption += f" · {ranks.rank_label(q)}"
        notes = [ranks.merged_gap(rd, df, q)]
        if q == "merged":
            def every() -> Any:
                rows = rd.step_records(step, ranks.ALL)
                return rows[(rows["iteration"] == it) & (rows["tensor"] == tensor)]
            notes.append(ranks.unbatched_note(rd, tensor, every))
        caption += "".join(f" · {n}" for n in notes if n)
    if item is not None:
        columns = [(h, d, v, False) for h, d, v, _ in columns]
        of = f" of rank {q if isinstance(q, int) else 0}" if q is not None else ""
        columns.append((f"batch item {_view_of(sel['batch'])[1]}{of}", sel["direction"], item,
                        True))
    elif why_not:
        caption += f" · whole batch ({why_not})"
    head = html.Tr([html.Th("statistic")] + [
        html.Th(h, className="sel-col" if chosen else None) for h, _, _, chosen in columns])
    rows, alarms = [], []
    for k, stat in enumerate(STAT_COLUMNS):
        cells = [html.Th(stat)]
        for h, _, values, chosen in columns:
            value = values[k]
            bad = stat in NONFINITE and value > 0
            if bad:
                alarms.append(f"{fmt(value)} {stat} in {h}")
            classes = " ".join(c for c in ("nonfinite" if bad else "",
                                           "sel-col" if chosen else "") if c)
            cells.append(html.Td(fmt(value), className=classes or None))
        rows.append(html.Tr(cells))
    table = html.Table([html.Caption(caption), html.Thead(head), html.Tbody(rows)],
                       className="stats", **{"data-tensor": tensor, "data-step": str(step),
                                             "data-direction": sel["direction"],
                                             "data-run": sel["run"]})
    banner = None
    if alarms:
        banner = html.Div("⚠ non-finite values: " + ", ".join(alarms), className="banner-bad",
                          role="alert")
    return banner, table


def _direction_name(d: str) -> str:
    return "gradient" if d == "grad" else d


def _item_stats(rd: RunData, sel: dict[str, Any],
                rank: ranks.QueryRank | None = None) -> tuple[list[float] | None, str]:
    """Statistics of the selected batch item from its stored full values (the recorder's own
    definitions), or None and why not: no item selected, or the stored values are not the
    item's exact values (cut to their first elements, or float32 copies of float64).
    rank: of a distributed run, the item is one of that rank's (the global batch's and
    all ranks': rank 0's, as the values chart)."""
    _, sample = _view_of(sel.get("batch") or "mean")
    if sample is None:
        return None, ""
    if rank == ranks.ALL:
        return None, f"item {sample}'s statistics: choose one rank"
    info = rd.tensor_info().get(sel["tensor"], {})
    if "float64" in str(info.get("dtype", "")):
        return None, f"item {sample}'s own statistics not shown: stored as float32"
    with rd.reading() as run:
        try:
            values = run.values(sel["tensor"], sel["step"], view="samples",
                                iteration=sel["record_iteration"], direction=sel["direction"],
                                rank=rank if isinstance(rank, int) else 0)
        except KeyError:
            return None, f"item {sample}'s values not stored"
    if sample >= len(values):
        return None, f"item {sample}'s values not stored"
    if values[sample].size >= SAMPLE_MAX_VALUES:
        return None, f"item {sample}'s values stored cut to {SAMPLE_MAX_VALUES} elements"
    return item_stats(values[sample]), ""


def item_stats(values: np.ndarray) -> list[float]:
    """`STAT_COLUMNS` of one batch item's stored values, as the recorder defines them
    (moments over the finite elements, non-finite counts beside; sv_max not computed)."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = x[np.isfinite(x)]
    n, count = x.size, finite.size
    mean = finite.sum() / count if count else math.nan
    row = {"numel": float(n), "mean": mean,
           "std": float(np.sqrt(np.mean((finite - mean) ** 2))) if count else math.nan,
           "abs_mean": float(np.abs(finite).sum() / count) if count else math.nan,
           "min": float(finite.min()) if count else math.nan,
           "max": float(finite.max()) if count else math.nan,
           "abs_max": float(np.abs(finite).max()) if count else math.nan,
           "norm": float(np.sqrt(np.dot(finite, finite))),
           "zero_frac": float(np.count_nonzero(x == 0) / max(n, 1)),
           "nan": float(np.isnan(x).sum()), "posinf": float(np.isposinf(x).sum()),
           "neginf": float(np.isneginf(x).sum()), "sv_max": math.nan}
    return [float(row[c]) for c in STAT_COLUMNS]


def _view_of(batch: str) -> tuple[str, int | None]:
    """Stored view and sample index for a batch-view choice."""
    if batch.startswith("sample:"):
        return "samples", int(batch.split(":", 1)[1])
    return BATCH_VIEWS.get(batch, "neuron_mean"), None


def _stored_views(rd: RunData, tensor: str) -> tuple[bool, bool]:
    """(any array views, per-batch-item views) for a tensor, known from its shape alone
    (listing stored views costs a scan over all steps of the tensor)."""
    info = rd.tensor_info().get(tensor, {})
    return bool(info.get("shape")), info.get("batch_dim") is not None


def values_panel(rd: RunData, sel: dict[str, Any], height: int = 240) -> Figure:
    """Per-neuron values (bar chart) or one stored batch item's values (bar / heatmap)."""
    tensor, step, it, direction = (sel["tensor"], sel["step"], sel["record_iteration"],
                                   sel["direction"])
    view, sample = _view_of(sel["batch"])
    label = "gradient" if direction == "grad" else direction
    if not _stored_views(rd, tensor)[0]:
        return message_figure(f"{tensor} is a scalar: see the statistics table", height=height)
    note = ""
    with rd.reading() as run:
        try:
            values = run.values(tensor, step, view=view, iteration=it, direction=direction)
        except KeyError:  # e.g. no full samples kept for this record: relax to the mean
            note = f" ({view} not stored; showing neuron_mean)"
            view, sample = "neuron_mean", None
            values = run.values(tensor, step, view=view, iteration=it, direction=direction)
    if sample is not None:
        if sample >= len(values):
            note = f" (batch has {len(values)} stored items)"
            sample = len(values) - 1
        values = values[sample]
        title = f"{tensor} {label}, batch item {sample} · step {step}{note}"
    else:
        title = f"{tensor} {label}: {view.replace('_', ' ')} · step {step}{note}"
    if rd.world_size() > 1:  # the values of one rank's micro-batch, not the global batch
        title += " · rank 0"
    fig = values_figure(np.asarray(values), title)
    # `meta` says what the figure shows: tests and the latency benchmark wait on it
    fig["layout"].update(height=height, meta={"tensor": tensor, "step": step,
                                              "direction": direction, "view": view})
    return fig


def items_panel(rd: RunData, sel: dict[str, Any]) -> Figure:
    """One value per batch item (mean / abs-max / std over its neurons); the chosen item is
    highlighted. Parameters have no batch dimension and say so."""
    tensor, step, it, direction = (sel["tensor"], sel["step"], sel["record_iteration"],
                                   sel["direction"])
    if not all(_stored_views(rd, tensor)):
        return message_figure(f"{tensor}: no per-batch-item values (no batch dimension)",
                              height=200)
    view, sample = _view_of(sel["batch"])
    stat = "abs_max" if view == "samples" else view.removeprefix("neuron_")
    with rd.reading() as run:
        values = run.values(tensor, step, view=f"sample_{stat}", iteration=it,
                            direction=direction)
    colours = ["#D55E00" if i == sample else "#56B4E9" for i in range(len(values))]
    data = [{"type": "bar", "x": list(range(len(values))),
             "y": [float(v) if math.isfinite(v) else None for v in values.tolist()],
             "marker": {"color": colours},
             "hovertemplate": "item %{x}: %{y:.4g}<extra></extra>"}]
    of = " · rank 0's items" if rd.world_size() > 1 else ""
    layout = base_layout(f"per batch item: {stat.replace('_', ' ')} over neurons{of}", height=200,
                         xaxis={"title": {"text": "batch item"}, **integer_axis(len(values))},
                         bargap=0.1)
    return {"data": data, "layout": layout}


def history(project: ProjectData, runs: Sequence[str], sel: dict[str, Any],
            statistic: str, height: int = 260, rank: str | None = None) -> Figure:
    """`statistic` of the selected tensor record over all recorded steps of the kind, one
    line per run (and per rank where `rank` is "all"); one SQL query per run. rank: the
    rank selector's value, for distributed runs (default: the global batch)."""
    traces, absent, which, gaps = [], [], set(), []
    for i, name in enumerate(dict.fromkeys(runs)):
        rd = project.run(name)
        q = ranks.query_rank(rd, rank)
        if isinstance(q, int) and q not in rd.run.ranks:  # an overlaid run with fewer ranks
            absent.append(f"{name} (no rank {q})")
            continue
        df = rd.history(sel["tensor"], sel["direction"], sel["record_iteration"], sel["kind"],
                        "merged" if q is None else q)
        if df.empty:
            absent.append(name)
            continue
        if q is not None:
            which.add(q)
            notes = [ranks.merged_gap(rd, df[[statistic]], q)]
            if q == "merged":
                notes.append(ranks.unbatched_note(rd, sel["tensor"], lambda rd=rd: rd.history(
                    sel["tensor"], sel["direction"], sel["record_iteration"], sel["kind"],
                    ranks.ALL)))
            gaps += [f"{name}: {n}" for n in notes if n]
        parts = ranks.split_ranks(df, q) if q is not None else [("", df)]
        for suffix, part in parts:  # a run keeps its colour unless it is split by rank
            traces.append(line_trace(name + suffix, part["step"], part[statistic],
                                     i if len(parts) == 1 else len(traces)))
    label = "gradient" if sel["direction"] == "grad" else sel["direction"]
    title = f"{statistic} of {sel['tensor']} ({label}) over steps · kind {sel['kind']}"
    if which:
        title += " · " + ", ".join(sorted(ranks.rank_label(q) for q in which))
    if not traces:
        return message_figure(f"{sel['tensor']} ({label}) is not recorded in "
                              f"{', '.join(absent)}", title, height=height)
    layout = base_layout(title, height=height, shapes=step_marker(sel["step"]),
                         showlegend=len(traces) > 1,
                         meta={"tensor": sel["tensor"], "direction": sel["direction"],
                               "statistic": statistic, "runs": [t["name"] for t in traces]})
    remarks = [*(["not recorded in " + ", ".join(absent)] if absent else []), *gaps]
    if remarks:
        layout["annotations"] = [note("; ".join(remarks))]
    return {"data": traces, "layout": layout}
