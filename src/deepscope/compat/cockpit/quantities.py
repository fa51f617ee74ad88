"""Cockpit's quantity classes. Each names a deepscope quantity and says when to compute it;
deepscope computes them all in one pass (`deepscope.instruments`), so these classes hold
no computation.

    quantities.GradNorm(track_schedule=schedules.linear(10))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .utils.schedules import linear


class Quantity:
    """A Cockpit quantity: what to compute (the class name) and when (`track_schedule`).

    Args:
        track_schedule: global_step -> bool (default: every step). An int n, Cockpit's
            older `track_interval`, means every n steps.
        verbose: accepted for Cockpit compatibility; deepscope logs through `logging`.
        options: Cockpit's tuning options (bins, range, curvature, ...). deepscope uses its
            own settings for them and warns once that they are not applied.
    """

    def __init__(self, track_schedule: Callable[[int], bool] | int | None = None,
                 verbose: bool = False, **options: Any) -> None:
        if track_schedule is None:
            track_schedule = linear(1)
        elif isinstance(track_schedule, int) and not isinstance(track_schedule, bool):
            track_schedule = linear(track_schedule)
        elif not callable(track_schedule):
            raise TypeError(f"{self.name}(track_schedule=...) needs a callable global_step -> "
                            f"bool, e.g. schedules.linear(1); got {type(track_schedule).__name__}")
        self._track_schedule = track_schedule
        self._verbose = verbose
        self.options = options
        if options:
            warnings.warn(f"deepscope: {self.name} options {', '.join(sorted(options))} are not "
                          "applied; deepscope computes it with its own settings "
                          "(see docs/migrating.md)", stacklevel=2)
        self.output: dict[int, Any] = {}

    @property
    def name(self) -> str:
        """The quantity's name in deepscope's store (its Cockpit class name)."""
        return type(self).__name__

    def should_compute(self, global_step: int) -> bool:
        """Whether this quantity is computed at `global_step`."""
        return bool(self._track_schedule(global_step))

    def create_graph(self, global_step: int) -> bool:
        """Always False: deepscope never needs the backward graph kept."""
        return False

    def extensions(self, global_step: int) -> list:
        """No BackPACK extensions: deepscope hooks what it needs itself."""
        return []

    def get_output(self) -> dict[int, Any]:
        """{global_step: value}, filled by the owning Cockpit's `get_output()`."""
        return self.output

    def __repr__(self) -> str:
        return f"{self.name}(track_schedule={self._track_schedule!r})"


class Loss(Quantity):
    """The mini-batch loss."""


class GradNorm(Quantity):
    """Gradient norm per parameter tensor."""


class Distance(Quantity):
    """Distance of each parameter tensor from its value when tracking began."""


class UpdateSize(Quantity):
    """Size of each parameter tensor's update at a step."""


class NormTest(Quantity):
    """Norm test of the gradient noise."""


class InnerTest(Quantity):
    """Inner-product test of the gradient noise."""


class OrthoTest(Quantity):
    """Orthogonality test of the gradient noise."""


class GradHist1d(Quantity):
    """Histogram of per-sample gradient elements."""


class GradHist2d(Quantity):
    """Histogram of (parameter, per-sample gradient) element pairs."""


class Alpha(Quantity):
    """α, the normalised step length of the update (noise-aware quadratic fit)."""


class HessTrace(Quantity):
    """Hessian trace per parameter tensor."""


class TICDiag(Quantity):
    """Takeuchi information criterion with the Hessian diagonal."""


class TICTrace(Quantity):
    """Takeuchi information criterion with the Hessian trace."""


class HessMaxEV(Quantity):
    """Largest Hessian eigenvalue."""


class MeanGSNR(Quantity):
    """Mean gradient signal-to-noise ratio."""


class CABS(Quantity):
    """Batch size suggested by CABS (coupled adaptive batch size)."""


class EarlyStopping(Quantity):
    """Evidence-based early-stopping criterion."""


def by_name(name: str) -> type[Quantity]:
    """The quantity class called `name` (Cockpit spelling, e.g. "GradNorm").

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
    """
    cls = globals().get(name)
    if not (isinstance(cls, type) and issubclass(cls, Quantity) and cls is not Quantity):
        known = ", ".join(c.__name__ for c in Quantity.__subclasses__())
        raise ValueError(f"unknown quantity {name!r}; known quantities: {known}")
    return cls


__all__ = ["CABS", "Alpha", "Distance", "EarlyStopping", "GradHist1d", "GradHist2d", "GradNorm",
           "HessMaxEV", "HessTrace", "InnerTest", "Loss", "MeanGSNR", "NormTest", "OrthoTest",
           "Quantity", "TICDiag", "TICTrace", "UpdateSize", "by_name"]
