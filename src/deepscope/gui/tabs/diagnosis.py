"""The Diagnosis tab: the run's likely bugs (deepscope.diagnosis), each a button to the step
and node it names in the graph tab (the graph tab's selection callback handles the click and
shows that tab), then the evidence that was missing, then the health check's low-level
findings.

Its value and content id are still "anomalies" (the tab's former name), kept for stable ids.
"""

from __future__ import annotations

from typing import Any

from dash import html

from ...diagnosis import THRESHOLD, examine
from .. import ids, panels
from ..data import RunData
from ..widgets import list_table
from . import run_card


def _diagnosis(rd: RunData, run: str) -> list[Any]:
    found, missing = rd.cached("diagnoses", lambda r: examine(r))
    findings = rd.cached("anomalies", lambda r: r.anomalies())
    return [*_diagnoses(run, found), *_missing(missing), *_findings(run, findings)]


def _diagnoses(run: str, found: list) -> list[Any]:
    sure = [d for d in found if d.confidence >= THRESHOLD]
    head = html.H2(f"Diagnosis of {run}")
    if not sure:
        return [head, html.P("Nothing above the reporting threshold: no known bug pattern in "
                             "the recorded evidence.", className="hint")]
    rows = []
    for i, d in enumerate(sure, 1):
        button = html.Button(f"{d.where} · step {d.step}" if d.step is not None else d.where,
                             id=ids.go_id(d.step, d.where), className="node-btn diag-go",
                             title="show it in the graph tab")
        rows.append([html.Td(i), html.Td(d.code, className="diag-code"),
                     html.Td(f"{d.confidence:.2f}"), html.Td(button), html.Td(d.summary),
                     html.Td(d.fix)])
    table = list_table(["#", "diagnosis", "confidence", "where (click: graph)", "evidence",
                         "fix"], rows)
    return [head, table]


def _missing(missing: list) -> list[Any]:
    if not missing:
        return []
    seen, items = set(), []
    for m in missing:
        if m.what in seen:
            continue
        seen.add(m.what)
        text = (f"{', '.join(m.codes)}: no {m.what} — gather it with {m.setting}"
                if m.setting else f"{', '.join(m.codes)}: {m.what}")
        items.append(html.Li(text))
    return [html.H3("Missing evidence"), html.Ul(items, className="hint")]


def _findings(run: str, found: Any) -> list[Any]:
    head = html.H3("Health-check findings")
    if found.empty:
        return [head, html.P(f"No anomalies recorded in {run}.", className="hint")]
    cols = ["step", "kind", "tensor", "detector", "value", "threshold", "message"]
    cols = ["rank", *cols] if "rank" in found else cols  # a distributed run: every rank's
    return [head, list_table(cols, [
        [html.Td(panels.fmt(v) if isinstance(v, float) else v) for v in row]
        for row in found[cols].itertuples(index=False)])]


TAB = run_card("Diagnosis", "anomalies", "anomalies", _diagnosis)  # value, content div
