"""GradHist1d and GradHist2d as the suite computes them: the settings (validated once),
both histograms of a step from one pass over the per-sample gradients, and their values
(total first, then per parameter tensor)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from operator import add
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..base import TOTAL, QuantityValue
from . import GradHistogram, finite_abs_max
from .bins import Bins, Histogram, symmetric_bins

if TYPE_CHECKING:
    from ..batch import Batch

HIST2D_BINS = (40, 50)
HIST2D_RANGE = ((-1.0, 1.0), (-2.0, 2.0))
HISTOGRAM_NAMES = frozenset({"GradHist1d", "GradHist2d"})

# name -> (per parameter tensor, meta)
StepHistograms = dict[str, tuple[dict[str, Histogram], dict[str, Any]]]


@dataclass(frozen=True)
class HistogramSettings:
    """The suite's histogram axes (see `Instruments` for the arguments).

    bins: GradHist1d's axis, None for "adaptive" (then `count` bins on a symmetric range
    found at each step); hist2d: GradHist2d's (θ, gᵢ) axes; per_layer_2d: also store
    GradHist2d per parameter tensor.
    """

    bins: Bins | None
    count: int
    hist2d: tuple[Bins, Bins]
    per_layer_2d: bool

    @classmethod
    def from_arguments(
        cls,
        hist_bins: int,
        hist_range: tuple[float, float] | str,
        hist2d_bins: tuple[int, int],
        hist2d_range: tuple[tuple[float, float], tuple[float, float]],
        hist2d_per_layer: bool,
    ) -> HistogramSettings:
        """Validate the arguments, raising a one-line ValueError naming the bad one."""
        if hist_range == "adaptive":
            bins = None
            Bins(hist_bins, -1.0, 1.0)  # validates the bin count now
        elif isinstance(hist_range, (tuple, list)) and len(hist_range) == 2:
            bins = Bins(hist_bins, float(hist_range[0]), float(hist_range[1]))
        else:
            raise ValueError(f"hist_range must be (lo, hi) or 'adaptive', got {hist_range!r}")
        if len(hist2d_bins) != 2 or len(hist2d_range) != 2:
            raise ValueError("hist2d_bins and hist2d_range need two entries each (θ, gᵢ), got "
                             f"{hist2d_bins!r} and {hist2d_range!r}")
        param_bins, grad_bins = (Bins(n, float(lo), float(hi))
                                 for n, (lo, hi) in zip(hist2d_bins, hist2d_range))
        return cls(bins, hist_bins, (param_bins, grad_bins), bool(hist2d_per_layer))


def histogram_pass(
    settings: HistogramSettings, batch: Batch, due: frozenset[str], names: list[str],
    theta: list[Tensor] | None,
) -> StepHistograms:
    """GradHist1d and GradHist2d (those `due`) per parameter tensor (`names`, at values
    `theta`), from one pass over the per-sample gradients, part by part."""
    counters, meta = histogram_counters(settings, batch, due, theta and dict(zip(names, theta)))
    return {name: ({n: counters[name][n].result() for n in names
                    if n in counters[name]}, meta[name]) for name in counters}


def local_abs_max(batch: Batch) -> float:
    """max |gᵢ,ₐ| over the finite per-sample gradient elements of this batch (an "adaptive"
    GradHist1d range's bound)."""
    return finite_abs_max(part for n, part in batch.engine.per_sample_parts()
                          if n not in batch.unavailable())


@dataclass(frozen=True)
class SweptHistograms:
    """The step's due histograms (name -> counter) of one parameter tensor, counted on
    the way by a statistics sweep (`PerSampleEngine.count_in_sweeps`)."""

    counters: dict[str, GradHistogram]

    def add(self, part: Tensor) -> None:
        for counter in self.counters.values():
            counter.add(part)


def sweep_counters(
    settings: HistogramSettings, due: frozenset[str], names: list[str],
    theta: list[Tensor] | None,
) -> Callable[[str], SweptHistograms] | None:
    """For `PerSampleEngine.count_in_sweeps`: parameter name -> new counters of the due
    histograms (θ by `names`, for GradHist2d); None when none is due, or GradHist1d's
    range is "adaptive" (the bound needs a pass of its own first)."""
    due = HISTOGRAM_NAMES & due
    if not due or ("GradHist1d" in due and settings.bins is None) or (
            "GradHist2d" in due and theta is None):
        return None
    values = dict(zip(names, theta or []))
    param_bins, grad_bins = settings.hist2d

    def new(pname: str) -> SweptHistograms:
        counters = {}
        if "GradHist1d" in due and settings.bins is not None:
            counters["GradHist1d"] = GradHistogram(settings.bins)
        if "GradHist2d" in due:
            counters["GradHist2d"] = GradHistogram(grad_bins, values[pname], param_bins)
        return SweptHistograms(counters)
    return new


def histogram_counters(
    settings: HistogramSettings, batch: Batch, due: frozenset[str],
    theta: dict[str, Tensor] | None, bound: float | None = None,
) -> tuple[dict[str, dict[str, GradHistogram]], dict[str, dict[str, Any]]]:
    """The counters of GradHist1d and GradHist2d (those `due`) per parameter tensor with
    per-sample gradients (θ by name, for GradHist2d), filled in one pass, and each one's
    meta. bound: an "adaptive" GradHist1d range's bound (default: this batch's)."""
    due = HISTOGRAM_NAMES & due
    meta: dict[str, dict[str, Any]] = {name: {} for name in due}
    engine = batch.engine
    bins = settings.bins
    # batch.unavailable() is complete once the engine yielded its first part
    if "GradHist1d" in due and bins is None:  # adaptive: a first pass for the range
        bins = symmetric_bins(settings.count, local_abs_max(batch) if bound is None else bound)
        meta["GradHist1d"]["range"] = "adaptive"
    values = theta or {}
    param_bins, grad_bins = settings.hist2d
    counters: dict[str, dict[str, GradHistogram]] = {name: {} for name in due}
    # what the statistics' sweeps counted already (`sweep_counters`, of these histograms)
    swept = {n: h for n, h in engine.swept.items() if n not in batch.unavailable()
             and isinstance(h, SweptHistograms) and set(h.counters) == due}
    for pname, histograms in swept.items():
        for name, counter in histograms.counters.items():
            counters[name][pname] = counter
    for pname, part in engine.per_sample_parts(skip=swept):
        if pname in batch.unavailable():
            continue
        if "GradHist1d" in due:
            counters["GradHist1d"].setdefault(pname, GradHistogram(bins)).add(part)
        if "GradHist2d" in due:  # (a GradHistogram costs nothing until its first add)
            counters["GradHist2d"].setdefault(
                pname, GradHistogram(grad_bins, values[pname], param_bins)).add(part)
    if batch.unavailable():
        for extra in meta.values():
            extra["excluded"] = sorted(batch.unavailable())
    return counters, meta


def histogram_values(
    name: str, step: int, settings: HistogramSettings, results: StepHistograms,
    unavailable: dict[str, str],
) -> list[QuantityValue]:
    """GradHist1d / GradHist2d values from the step's `results`: total, and per layer
    (2-D: if per_layer_2d); `unavailable`: parameter -> why it has no per-sample gradients."""
    per_layer, meta = results[name]
    if not per_layer:
        raise ValueError("no parameter has per-sample gradients at this step")
    total = reduce(add, per_layer.values())
    out = [_value(name, step, TOTAL, total, meta)]
    if name == "GradHist1d" or settings.per_layer_2d:
        out += [_value(name, step, n, h, meta) for n, h in per_layer.items()]
        out += [QuantityValue(name, step, n,
                              meta={"reason": f"per-sample gradients unavailable: {why}"})
                for n, why in unavailable.items()]
    return out


def _value(name: str, step: int, layer: str, hist: Histogram,
           meta: dict[str, Any]) -> QuantityValue:
    return QuantityValue(name, step, layer, array=hist.counts, meta={**hist.meta(), **meta})
