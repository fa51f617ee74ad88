"""Cockpit's quantity classes (`cockpit.quantities`). Each names a deepscope quantity, says
when to compute it and carries Cockpit's options; deepscope computes them all in one pass
(`deepscope.instruments`). `Time` and `Parameters` are taken by this layer itself.

    quantities.GradNorm(track_schedule=schedules.linear(10))
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from .... import catalogue
from ....instruments.histograms import Bins
from ..utils.schedules import linear
from .bin_adaptation import BinAdaptation, NoAdaptation


class Quantity:
    """A Cockpit quantity: what to compute (the class name) and when (`track_schedule`).

    Args:
        track_schedule: global_step -> bool (default: every step). An int n, Cockpit's
            older `track_interval`, means every n steps.
        verbose: accepted for Cockpit compatibility; deepscope logs through `logging`.
        options: Cockpit options deepscope does not apply; each one given warns once.

    `output` ({global_step: value}) fills in as the owning `Cockpit` tracks steps.
    """

    # False: not a deepscope instrument; this layer takes it when the step is tracked
    instrument: ClassVar[bool] = True

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
                          "(see docs/migrating.md)", stacklevel=3)
        self.output: defaultdict[int, Any] = defaultdict(dict)

    @property
    def name(self) -> str:
        """The quantity's name in deepscope's store: the catalogue's quantity Cockpit calls
        by this class name (the class name where the catalogue has none: Parameters, Time)."""
        return catalogue.by_cockpit(type(self).__name__) or type(self).__name__

    def should_compute(self, global_step: int) -> bool:
        """Whether this quantity is computed at `global_step`."""
        return bool(self._track_schedule(global_step))

    def create_graph(self, global_step: int) -> bool:
        """Always False: deepscope never needs the backward graph kept."""
        return False

    def extensions(self, global_step: int) -> list:
        """No BackPACK extensions: deepscope hooks what it needs itself."""
        return []

    def instrument_options(self) -> dict[str, Any]:
        """Settings of deepscope's `Instruments` this quantity's options ask for."""
        return {}

    def get_output(self) -> defaultdict[int, Any]:
        """{global_step: value}, as Cockpit's: filled after each tracked step."""
        return self.output

    def __repr__(self) -> str:
        return f"{self.name}(track_schedule={self._track_schedule!r})"


def _changed(**given: tuple[Any, Any]) -> dict[str, Any]:
    """The options (value, Cockpit's default) whose value is not the default."""
    return {name: value for name, (value, default) in given.items() if value != default}


def _adaptations(*adapt: BinAdaptation | None) -> dict[str, Any]:
    """{"adapt": ...} when a bin adaptation other than none is asked for (not applied)."""
    active = [a for a in adapt if a is not None and not isinstance(a, NoAdaptation)]
    return {"adapt": active} if active else {}


class Loss(Quantity):
    """The mini-batch loss."""


class Parameters(Quantity):
    """The parameters (NumPy copies, in `params` order) when the step is tracked, i.e.
    after the backward pass and before the optimiser step."""

    instrument = False

    def take(self, params: Sequence[torch.Tensor]) -> list[np.ndarray]:
        """The value at the current step (called by `Cockpit`)."""
        return [p.detach().cpu().numpy().copy() for p in params]


class Distance(Quantity):
    """Distance of each parameter tensor from its value when tracking began."""


class UpdateSize(Quantity):
    """Size of each parameter tensor's update at a step (shown once the next step is
    tracked, as Cockpit does)."""


class GradNorm(Quantity):
    """Gradient norm per parameter tensor."""


class Time(Quantity):
    """Wall-clock time (`time.time()`, seconds) when the step is tracked."""

    instrument = False

    def take(self, params: Sequence[torch.Tensor]) -> float:
        """The value at the current step (called by `Cockpit`)."""
        return time.time()


class Alpha(Quantity):
    """α, the normalised step length of the update (noise-aware quadratic fit)."""


class CABS(Quantity):
    """Batch size suggested by CABS (coupled adaptive batch size); plain SGD only."""


class EarlyStopping(Quantity):
    """Evidence-based early-stopping criterion; plain SGD only."""

    def __init__(self, track_schedule: Callable[[int], bool] | int | None = None,
                 verbose: bool = False, epsilon: float = 1e-5) -> None:
        super().__init__(track_schedule, verbose, **_changed(epsilon=(epsilon, 1e-5)))


class GradHist1d(Quantity):
    """Histogram of per-sample gradient elements: `bins` bins on `range`, outliers counted
    in the edge bins as Cockpit does."""

    def __init__(self, track_schedule: Callable[[int], bool] | int | None = None,
                 verbose: bool = False, bins: int = 100,
                 range: tuple[float, float] = (-2, 2),  # noqa: A002 - Cockpit's name
                 adapt: BinAdaptation | None = None) -> None:
        super().__init__(track_schedule, verbose, **_adaptations(adapt))
        self.bins = Bins(bins, float(range[0]), float(range[1]))

    def instrument_options(self) -> dict[str, Any]:
        return {"hist_bins": self.bins.count, "hist_range": (self.bins.lo, self.bins.hi)}


class GradHist2d(Quantity):
    """2-D histogram of (per-sample gradient, parameter) element pairs: `bins` and `range`
    are (gradient axis, parameter axis), as are Cockpit's and the output's axes."""

    def __init__(self, track_schedule: Callable[[int], bool] | int | None = None,
                 verbose: bool = False, bins: tuple[int, int] = (40, 50),
                 range: tuple[tuple[float, float], tuple[float, float]] = (  # noqa: A002
                     (-1, 1), (-2, 2)),
                 adapt: tuple[BinAdaptation | None, BinAdaptation | None] = (None, None),
                 keep_individual: bool = False) -> None:
        super().__init__(track_schedule, verbose, **_adaptations(*adapt))
        if len(bins) != 2 or len(range) != 2:
            raise ValueError(f"GradHist2d needs bins=(gradient, parameter) and range=((lo, hi), "
                             f"(lo, hi)), got bins={bins!r}, range={range!r}")
        self.grad_bins, self.param_bins = (Bins(n, float(lo), float(hi))
                                           for n, (lo, hi) in zip(bins, range))
        self.keep_individual = bool(keep_individual)

    def instrument_options(self) -> dict[str, Any]:
        # deepscope's axes are (parameter, gradient)
        return {"hist2d_bins": (self.param_bins.count, self.grad_bins.count),
                "hist2d_range": ((self.param_bins.lo, self.param_bins.hi),
                                 (self.grad_bins.lo, self.grad_bins.hi)),
                "hist2d_per_layer": self.keep_individual}


class NormTest(Quantity):
    """Norm test of the gradient noise."""


class InnerTest(Quantity):
    """Inner-product test of the gradient noise."""


class OrthoTest(Quantity):
    """Orthogonality test of the gradient noise."""


class HessMaxEV(Quantity):
    """Largest Hessian eigenvalue."""


class HessTrace(Quantity):
    """Hessian trace per parameter tensor."""

    def __init__(self, track_schedule: Callable[[int], bool] | int | None = None,
                 verbose: bool = False, curvature: str = "diag_h") -> None:
        super().__init__(track_schedule, verbose, **_changed(curvature=(curvature, "diag_h")))


class _TIC(Quantity):
    """Cockpit's options of the two TIC variants."""

    def __init__(self, track_schedule: Callable[[int], bool] | int | None = None,
                 verbose: bool = False, curvature: str = "diag_h",
                 epsilon: float = 1e-7) -> None:
        super().__init__(track_schedule, verbose, **_changed(
            curvature=(curvature, "diag_h"), epsilon=(epsilon, 1e-7)))


class TICDiag(_TIC):
    """Takeuchi information criterion with the Hessian diagonal."""


class TICTrace(_TIC):
    """Takeuchi information criterion with the Hessian trace."""


class MeanGSNR(Quantity):
    """Mean gradient signal-to-noise ratio (always in float64, so `use_double` is moot)."""

    def __init__(self, track_schedule: Callable[[int], bool] | int | None = None,
                 verbose: bool = False, epsilon: float = 1e-5, use_double: bool = False) -> None:
        super().__init__(track_schedule, verbose, **_changed(epsilon=(epsilon, 1e-5)))


def by_name(name: str) -> type[Quantity]:
    """The quantity class called `name` (Cockpit spelling, e.g. "GradNorm").

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
    """
    cls = globals().get(name) if name in __all__ else None
    if not (isinstance(cls, type) and issubclass(cls, Quantity) and cls is not Quantity):
        known = ", ".join(n for n in __all__ if n != "Quantity")
        raise ValueError(f"unknown quantity {name!r}; known quantities: {known}")
    return cls


# Cockpit 1.0.2's list, in its order: only the quantity classes
__all__ = ["Quantity", "Loss", "Parameters", "Distance", "UpdateSize", "GradNorm", "Time",
           "Alpha", "CABS", "EarlyStopping", "GradHist1d", "GradHist2d", "NormTest",
           "InnerTest", "OrthoTest", "HessMaxEV", "HessTrace", "TICDiag", "TICTrace",
           "MeanGSNR"]
