"""Training health: the first NaN/Inf traced to its origin, spikes and vanishing gradients.

`HealthMonitor` (driven by `deepscope.Scope(..., anomalies=True)` or by hand) checks every
step at bounded cost and writes `Finding` rows; `deepscope doctor RUN` reports them. The
detectors and their default thresholds are documented in `deepscope.anomalies.detectors`.

The names load on first use: `deepscope doctor` reads a run without loading torch.
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

_HOMES = {
    **dict.fromkeys(["RELU_LIKE", "DeadUnits", "Detector", "GradientNorm", "LossSpike",
                     "StepContext", "UpdateRatio", "default_detectors"], ".detectors"),
    "Finding": ".findings", "StopTraining": ".findings", "HealthMonitor": ".monitor",
}

__all__ = ["RELU_LIKE", "DeadUnits", "Detector", "Finding", "GradientNorm", "HealthMonitor",
           "LossSpike", "StepContext", "StopTraining", "UpdateRatio", "default_detectors"]

if TYPE_CHECKING:
    from .detectors import (
        RELU_LIKE,
        DeadUnits,
        Detector,
        GradientNorm,
        LossSpike,
        StepContext,
        UpdateRatio,
        default_detectors,
    )
    from .findings import Finding, StopTraining
    from .monitor import HealthMonitor

__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)
