"""The typed records that cross the write path: recorder and instruments build them, the store
writes them. This module sits below every other deepscope module (numpy only, no torch), so
the store, the query API and the GUI can name them without loading what produces them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

TOTAL = ""  # the `layer` of a whole-model value


@dataclass
class QuantityValue:
    """One stored value of a quantity at one step.

    name:   Cockpit name, e.g. "GradNorm", "Alpha", "GradHist1d".
    step:   the step the value belongs to (Alpha and UpdateSize: step t, computed later).
    layer:  "" for the whole model, else a parameter's dotted name (e.g. "0.weight").
    value:  the scalar, or None when missing (then `meta["reason"]` says why) or when
            the value is an array.
    array:  histogram counts or another array (float64 / int64), else None.
    meta:   JSON-serialisable extras: estimator, samples, edges, under/overflow,
            nan/posinf/neginf counts, reason for a missing value.
    local:  True for a value of this rank's own micro-batch in a distributed run (its local
            loss, its pre-sync gradient norm, its batch size), stored in the rank's
            `local_quantities` table; False for a value of the global batch.
    """

    name: str
    step: int
    layer: str = TOTAL
    value: float | None = None
    array: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    local: bool = False


@dataclass(frozen=True)
class InstrumentWarning:
    """Something about a run's recording the user may want to change, stored once per run.

    step:       the step at which it first occurred (None: outside any step).
    location:   what it is about: a module label ("BatchNorm1d 'bn'"), a parameter
                ("parameter 'head.weight'"), or "" for the whole model.
    quantities: the instrument quantities whose values it affects.
    message:    one line: what happened and what to do.
    """

    step: int | None
    location: str
    quantities: tuple[str, ...]
    message: str

    def text(self) -> str:
        """The one-line form shown to the user: location and message."""
        return f"{self.location}: {self.message}" if self.location else self.message


@dataclass
class TensorInfo:
    """Static description of a named tensor (stored once per name)."""

    name: str
    role: str
    node: str
    role_in_node: str
    shape: list[int]
    dtype: str
    batch_dim: int | None


@dataclass
class StepSummary:
    """A recorded step's statistics and arrays, ready to insert.

    keys: (name, direction, iteration) of each row of `stats`, a (R, len(STAT_COLUMNS)) float64
    array (NaN = missing). parts: the step's arrays packed as little-endian bytes, one part per
    dtype; arrays: (name, direction, view, iteration, dtype, JSON shape, part, offset, nbytes)
    of each array, `offset` and `nbytes` in bytes within `parts[part]`. compress: per part,
    whether compressing it is worth its time (dense float32 values shrink by ~25% at ~60 MB/s:
    on large activations that would cost more than the whole summary); default all.
    """

    keys: list[tuple[str, str, int]]
    stats: np.ndarray
    arrays: list[tuple[str, str, str, int, str, str, int, int, int]]
    parts: list[bytes]
    compress: list[bool] | None = None


@runtime_checkable
class GroupSummary(Protocol):
    """A step's summary job that can run together with other steps' of equal `key` (one
    pass over all their tensors: fewer ops per step), e.g. `recorder.summary.StepCaptures`."""

    @property
    def key(self) -> Hashable: ...

    def __call__(self) -> StepSummary: ...

    def together(self, jobs: list[Any]) -> list[StepSummary]:
        """The summaries of `jobs` (all of this key), in order: each as its job's alone."""
        ...


@dataclass
class StepPayload:
    """Everything one recorded step writes, committed as one transaction.

    summarise: called on the writer thread, returns the step's `StepSummary`: computing it
    there keeps the work off the training thread. A `GroupSummary` may be summarised
    together with those of the steps queued next to it.
    """

    step: int
    kind: str
    wall_time: float
    iterations: int
    tensors: list[TensorInfo] = field(default_factory=list)
    summarise: Callable[[], StepSummary] | None = None
    graphs: dict[str, str] = field(default_factory=dict)
    iteration_graphs: list[tuple[int, str]] = field(default_factory=list)
    quantities: list[QuantityValue] = field(default_factory=list)
    anomalies: list[tuple[int, str, str, float | None, float | None, str]] = field(
        default_factory=list)
    # (name, step, kind, value) KPI rows committed with the step (those of the unrecorded
    # steps since the last commit included): no commit of their own on recorded steps
    kpis: list[tuple[str, int, str, Any]] = field(default_factory=list)
