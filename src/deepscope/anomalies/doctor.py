"""`deepscope doctor`: a run's diagnoses (deepscope.diagnosis), then its anomaly findings and
where to look in the GUI."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..query import Project, Run
from ..query.ranks import describe as describe_ranks
from ..store.layout import is_run_dir

# Where each finding can be inspected in `deepscope serve` (tab names as the GUI shows them).
_WHERE = {
    "nonfinite": "Graph tab at step {step}: node {tensor} (forward or gradient view, as the "
                 "message says); the steps after it are recorded in full",
    "exploding_gradient": "Instruments tab, GradNorm of layer {tensor}; Graph tab coloured by "
                          "quantity: GradNorm",
    "vanishing_gradient": "Instruments tab, GradNorm of layer {tensor}; Graph tab coloured by "
                          "quantity: GradNorm",
    "loss_spike": "KPIs tab, {tensor} around step {step}",
    "saturation": "Graph tab: node {tensor}, its per-neuron values at a recorded step",
    "dead_units": "Graph tab: node {tensor}, its per-neuron values at a recorded step",
    "update_ratio": "Instruments tab, UpdateSize of layer {tensor}",
}
_DEFAULT_WHERE = "Diagnosis tab (findings), step {step}, tensor {tensor}"


def report(path: str | Path, rank: int = 0, limit: int = 10) -> str:
    """The doctor report of a run folder, or of every run in a project folder.

    limit: findings listed per detector (the count is always complete)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"no run folder at {path}; pass a run folder such as runs/baseline "
                         "(or a project folder of runs)")
    names = Project(path).runs()
    if not names:
        raise ValueError(f"no deepscope runs in {path}; pass a run folder such as "
                         "runs/baseline")
    parts = []
    for name in names:
        with Run(path if is_run_dir(path) else path / name) as run:
            parts.append(_run_report(run, rank, limit))
    return "\n\n".join(parts)


def _run_report(run: Run, rank: int, limit: int) -> str:
    from ..diagnosis.report import diagnosis_text  # diagnoses first, the findings below
    return diagnosis_text(run, rank) + "\n\n" + _findings_report(run, rank, limit)


def _findings_report(run: Run, rank: int, limit: int) -> str:
    found = run.anomalies(rank)
    head = f"run {run.name} ({run.path}, rank {rank})"
    if ranks := describe_ranks(run.manifest(), run.status):
        head += f" [{ranks}]"
    if found.empty:
        return (f"{head}: no anomalies recorded.\n  (Findings come from "
                "deepscope.Scope(..., anomalies=True); none means every checked step was "
                "finite and no detector fired.)" + _warnings_text(run, rank))
    counts = found["detector"].value_counts()
    lines = [f"{head}: {len(found)} finding{'s' if len(found) != 1 else ''} — "
             + ", ".join(f"{n} {d}" for d, n in counts.items())]
    recorded = run.steps(rank=rank)
    nonfinite = found[found["detector"] == "nonfinite"]
    if not nonfinite.empty:
        first = nonfinite.iloc[0]
        step = int(first["step"])
        lines += ["", f"FIRST NON-FINITE VALUE: step {step}, {first['tensor']}",
                  f"  {first['message']}",
                  f"  look: {_where(first)}",
                  f"  recorded steps from there: {_recorded_from(recorded, step)}"]
        if len(nonfinite) > 1:
            later = ", ".join(str(int(s)) for s in nonfinite["step"].iloc[1:6])
            lines.append(f"  non-finite again later (new episodes) at steps {later}"
                         + (" ..." if len(nonfinite) > 6 else ""))
    for detector, rows in found.groupby("detector", sort=False):
        if detector == "nonfinite":
            continue
        lines += ["", f"{detector} ({len(rows)}) — look: {_where_group(rows)}"]
        for row in rows.head(limit).itertuples(index=False):
            lines.append(f"  step {int(row.step):>7}  {row.tensor:<32} {_num(row.value):>10} "
                         f"(threshold {_num(row.threshold)})  {row.message}")
        if len(rows) > limit:
            lines.append(f"  ... {len(rows) - limit} more (deepscope.open_run(path)"
                         ".anomalies() has them all)")
    lines += ["", f"GUI: deepscope serve {run.path.parent} → run {run.name} → Diagnosis "
              "tab: diagnoses (each row opens its step and node), then every finding."]
    return "\n".join(lines) + _warnings_text(run, rank)


def _warnings_text(run: Run, rank: int) -> str:
    """The run's recording warnings (instruments that could not be exact, ...), all of them:
    each distinct one was stored once."""
    found = run.warnings(rank)
    if found.empty:
        return ""
    lines = ["", "", f"RECORDING WARNINGS ({len(found)}) — values they affect are approximate "
             "or missing; the Instruments tab shows them beside those quantities:"]
    for row in found.itertuples(index=False):
        step = "-" if row.step is None or row.step != row.step else int(row.step)
        where = f"{row.location}: " if row.location else ""
        lines.append(f"  step {step:>7}  {where}{row.message}")
        if row.quantities:
            lines.append(f"  {'':>12} affects: {', '.join(row.quantities)}")
    return "\n".join(lines)


def _where(row: pd.Series) -> str:
    text = _WHERE.get(str(row["detector"]), _DEFAULT_WHERE)
    return text.format(step=int(row["step"]), tensor=row["tensor"])


def _where_group(rows: pd.DataFrame, shown: int = 3) -> str:
    """The hint for a group of findings of one detector, naming their steps and tensors."""
    def some(values: list) -> str:
        return ", ".join(map(str, values[:shown])) + (" ..." if len(values) > shown else "")
    text = _WHERE.get(str(rows["detector"].iloc[0]), _DEFAULT_WHERE)
    return text.format(step=some([int(s) for s in rows["step"].unique()]),
                       tensor=some(list(rows["tensor"].unique())))


def _recorded_from(recorded: list[int], step: int, n: int = 5) -> str:
    after = [s for s in recorded if s >= step][:n]
    return ", ".join(map(str, after)) if after else "none (no step at or after it was recorded)"


def _num(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.3g}"
