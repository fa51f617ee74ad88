"""The diagnosis section of `deepscope doctor`: ranked diagnoses, possible ones, and the
evidence that was missing with the setting that would gather it."""

from __future__ import annotations

from ..query.run import Run
from . import THRESHOLD, examine

POSSIBLE = 3  # candidates below the threshold listed as "possible"


def diagnosis_text(run: Run, rank: int = 0) -> str:
    """Diagnoses of one run, most likely first, as doctor prints them."""
    found, missing = examine(run, rank)
    sure = [d for d in found if d.confidence >= THRESHOLD]
    lines = [f"run {run.name} — DIAGNOSIS (confidence ≥ {THRESHOLD:g}, most likely first; "
             "deepscope.open_run(path).diagnoses() has the evidence)"]
    if not sure:
        lines.append("  nothing above the threshold: no known bug pattern in the recorded "
                     "evidence")
    for i, d in enumerate(sure, 1):
        at = f"step {d.step}" if d.step is not None else "run-wide"
        lines += [f"  {i}. {d.code} ({d.confidence:.2f}) at {d.where}, from {at}",
                  f"     {d.summary}", f"     fix: {d.fix}"]
    maybe = [d for d in found if d.confidence < THRESHOLD][:POSSIBLE]
    if maybe:
        lines.append("  possible (below the threshold): " + "; ".join(
            f"{d.code} at {d.where} ({d.confidence:.2f})" for d in maybe))
    seen: set[str] = set()
    for m in missing:
        if m.what in seen:
            continue
        seen.add(m.what)
        codes = ", ".join(m.codes)
        lines.append(f"  missing evidence for {codes}: no {m.what}; gather it with {m.setting}"
                     if m.setting else f"  could not judge {codes}: {m.what}")
    return "\n".join(lines)
