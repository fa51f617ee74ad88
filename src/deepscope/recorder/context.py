"""What passes between a `Scope` and the recorder of one of its steps, both ways, as two small
objects: the recorder gets a `StepContext` (it never imports the Scope), and hands back a
`StepOutcome` at the step's end, which the Scope routes to the writer, the instruments and
the health monitor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..records import QuantityValue, StepPayload
from .buffers import BufferPool
from .passes import ScaleCheck


@dataclass(frozen=True)
class StepContext:
    """The Scope's parts a step's recorder uses (built by the Scope for each step).

    scope: the Scope itself, only as `rec.scope` for the user. begin / end: the Scope's
    handling of the step's start and end, given the `StepRecorder` (end's bool: the step
    failed; typed Any here so that this module stays below the recorder). guard: runs
    fn(*args) so that a failure inside recording never stops training (logged once; returns
    a failure marker). params / param_nodes: watched parameters by name, and their (graph
    node, role in node). graph_cache: dependency graphs by structure, shared across steps.
    infos: the `TensorInfo` of each tensor description seen (name, role, shape, ...), and
    each parameter's, shared across steps (see `StepRecorder._info`). scaler: the GradScaler
    given to `watch` (recorded gradients are divided by its scale), else None; scale_check:
    says when a loss arrives scaled without one (see `passes`).
    """

    scope: Any
    begin: Callable[[Any], None]
    end: Callable[[Any, bool], None]
    guard: Callable[..., Any]
    warn_once: Callable[[str], None]
    params: dict[str, torch.Tensor]
    param_nodes: dict[str, tuple[str, str]]
    graph_cache: dict
    infos: dict
    buffers: BufferPool
    monitor: Any
    instruments: Any
    keep_if: Callable[[Any], bool] | None
    max_samples: int
    max_neurons: int
    singular_values: bool
    exact_views: bool
    scaler: Any
    scale_check: ScaleCheck


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~8x, on every step
class StepOutcome:
    """A step that has ended, for its Scope to store.

    failed: the user's step raised (nothing half-done is stored). instrumented: the
    instruments took part. kpis: (name, value) logged in the step. recorded: its tensors were
    captured; keep() then says whether to store them (dynamic recording), payload() builds
    what the writer stores. tentative: recorded only because `dynamic` chose it. local():
    this rank's BatchSize and Loss of a recorded step (for a distributed run's rank file).
    """

    step: int
    kind: str
    failed: bool
    instrumented: bool
    kpis: list[tuple[str, Any]]
    recorded: bool
    keep: Callable[[], bool]
    payload: Callable[[], StepPayload]
    tentative: bool = False
    local: Callable[[], list[QuantityValue]] = list
