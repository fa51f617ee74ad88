"""What every diagnosis is made of: the `Diagnosis` row, the `Evidence` a run offers, and the
`Missing` note that says which setting would have gathered absent evidence."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from ..query.run import Run

THRESHOLD = 0.5  # confidences at or above it are reported as diagnoses


@dataclass(frozen=True)
class Diagnosis:
    """One likely bug.

    code: stable identifier (see `CODES`). confidence: in [0, 1]; `THRESHOLD` and above is
    reported. step: the first step at which the evidence holds (None when it is run-wide).
    where: the tensor, layer or parameter it concerns ("model" for the whole model; the loss
    name for the loss). summary: one sentence with the numbers. evidence: the numbers it rests
    on, by name. fix: the suggested fix, one sentence.
    """

    code: str
    confidence: float
    step: int | None
    where: str
    summary: str
    evidence: dict[str, float | int | str]
    fix: str

    def as_row(self) -> dict[str, Any]:
        return {"code": self.code, "confidence": round(self.confidence, 3), "step": self.step,
                "where": self.where, "summary": self.summary, "evidence": dict(self.evidence),
                "fix": self.fix}


@dataclass(frozen=True)
class Missing:
    """Evidence a family of diagnoses needs that the run did not record: `what`, and the
    `setting` that would gather it ("" when the check itself failed; `what` says how)."""

    codes: tuple[str, ...]
    what: str
    setting: str


def combine(*scores: float) -> float:
    """Noisy-or of independent signals, each a probability-like score in [0, 1]."""
    keep = 1.0
    for s in scores:
        keep *= 1.0 - min(max(s, 0.0), 1.0)
    return 1.0 - keep


def ramp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    """y0 at x <= x0 rising linearly to y1 at x >= x1 (x in log space when the caller asks)."""
    if not math.isfinite(x):
        return y0
    t = min(max((x - x0) / (x1 - x0), 0.0), 1.0)
    return y0 + t * (y1 - y0)


@dataclass
class Evidence:
    """Lazily loaded views of one rank of a run, shared by all the checks.

    Everything comes through the query API. `missing` collects what a check needed and did
    not find, so that the report can say which setting would gather it.
    """

    run: Run
    rank: int = 0
    missing: list[Missing] = field(default_factory=list)

    def need(self, codes: tuple[str, ...], what: str, setting: str) -> None:
        self.missing.append(Missing(codes, what, setting))

    @cached_property
    def tensors(self) -> pd.DataFrame:
        return self.run.tensors(self.rank)

    @cached_property
    def wide(self) -> pd.DataFrame:
        """Statistics of every record, iterations included (one row per record)."""
        return self.run.stats_wide(rank=self.rank)

    def role(self, role: str) -> list[str]:
        return list(self.tensors.loc[self.tensors["role"] == role, "name"])

    def records(self, tensor: str, direction: str = "forward") -> pd.DataFrame:
        """Statistics of one tensor over the recorded steps (iterations pooled per step:
        the first iteration's row, which is the only one for most tensors)."""
        w = self.wide
        rows = w[(w["tensor"] == tensor) & (w["direction"] == direction)]
        return rows.drop_duplicates("step").reset_index(drop=True)  # sorted by step already

    @cached_property
    def anomalies(self) -> pd.DataFrame:
        return self.run.anomalies(self.rank)

    @cached_property
    def loss_name(self) -> str:
        losses = [n for n in self.role("loss") if not n.endswith("_per_sample")]
        return losses[0] if losses else "loss"

    @cached_property
    def loss(self) -> pd.Series:
        """The loss KPI of the most frequent step kind, by step (NaN where not finite)."""
        k = self.run.kpis(self.loss_name, rank=self.rank)
        if k.empty:
            return pd.Series(dtype=float)
        kind = k["kind"].value_counts().index[0]
        k = k[k["kind"] == kind]
        return pd.Series(k["value"].to_numpy(), index=k["step"].to_numpy(), dtype=float)

    @cached_property
    def quantities(self) -> pd.DataFrame:
        # rank 0's diagnosis reads the global values (a distributed run's rank 0 keeps its
        # own micro-batch's apart); another rank's, its own
        return self.run.quantities(rank=None if self.rank == 0 else self.rank)

    def quantity(self, name: str, layer: str = "") -> pd.Series:
        """One instrument's finite values by step (empty if not recorded)."""
        q = self.quantities
        q = q[(q["name"] == name) & (q["layer"] == layer)]
        values = q["value"].to_numpy(dtype=float)
        keep = np.isfinite(values)
        return pd.Series(values[keep], index=q["step"].to_numpy()[keep], dtype=float)

    @cached_property
    def params(self) -> list[str]:
        """Parameter names in model order."""
        return self.role("parameter")

    @cached_property
    def edges(self) -> list[tuple[str, str]]:
        """Edges of the dependency graph of the last recorded step, all its iterations
        ([] without one)."""
        steps = self.run.step_table(self.rank)
        if steps.empty:
            return []
        last = steps.iloc[-1]
        edges: set[tuple[str, str]] = set()
        for it in range(int(last["iterations"])):
            try:
                graph = self.run.graph(int(last["step"]), iteration=it, rank=self.rank)
            except ValueError:
                continue
            edges |= {(e["source"], e["target"]) for e in graph["edges"]}
        return sorted(edges)

    @cached_property
    def batch_size(self) -> int | None:
        """Batch items of the per-sample loss (None without one)."""
        t = self.tensors
        rows = t[(t["role"] == "loss") & t["batch_dim"].notna()]
        for shape in rows["shape"]:
            if shape:
                return int(shape[0])
        return None


def frac_steps(mask: pd.Series | np.ndarray) -> float:
    """Share of True in a boolean series (0 when empty)."""
    arr = np.asarray(mask, dtype=bool)
    return float(arr.mean()) if arr.size else 0.0


def first_step(steps: Any, mask: Any) -> int | None:
    """The first step where `mask` holds."""
    steps, mask = np.asarray(steps), np.asarray(mask, dtype=bool)
    return int(steps[mask][0]) if mask.any() else None


def fmt(x: float) -> str:
    return f"{x:.3g}"
