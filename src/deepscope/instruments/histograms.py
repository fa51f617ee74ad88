"""Exact histograms of per-sample gradient elements (GradHist1d) and of (θₐ, gᵢ,ₐ) pairs
(GradHist2d), computed on the tensors' device: per chunk of values one scalar min / max
check goes to the host, and at the end the counts.

Binning is numpy.histogram's with ``range=(lo, hi)`` on the data's own dtype: edges
``np.linspace(lo, hi, bins + 1, dtype=<data dtype>)``, bin k holds e_k <= x < e_{k+1}, the
last bin also holds x = hi. float16 / bfloat16 data are binned as float32 (exact upcast).
Unlike Cockpit, nothing is clamped into the edge bins: finite values below lo / above hi
are counted as underflow / overflow, and NaN, +Inf, -Inf separately.

Why it is fast: per-sample gradient elements are overwhelmingly small, and every value
strictly between the nearest negative and the nearest positive edge falls into a bin
fixed by its sign alone. So most elements are only counted by sign (a few vectorised
passes over cache-sized chunks), and only the rest ("outer" elements) are binned
individually.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

# extra classes after the `bins` regular ones, in this order
EXTRAS: tuple[str, ...] = ("underflow", "overflow", "nan", "posinf", "neginf")
_UNDER, _OVER, _NAN, _POSINF, _NEGINF = range(len(EXTRAS))
# elements per chunk: about 4 MB of float32 on CPU keeps each chunk's passes in cache;
# on an accelerator fewer, bigger chunks mean fewer host synchronisations.
_CHUNK_ELEMENTS = {"cpu": 1 << 20}
_CHUNK_ELEMENTS_OTHER = 1 << 24
_BLOCK = 128  # values per block when screening a chunk for outer values


@dataclass(frozen=True)
class Bins:
    """One axis: `count` equal-width bins on [lo, hi] (numpy.histogram semantics).

    Raises:
        TypeError / ValueError: for a non-int or non-positive count, non-finite bounds,
        or lo >= hi.
    """

    count: int
    lo: float
    hi: float

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int):
            raise TypeError(f"histogram bins must be an int, got {type(self.count).__name__}")
        if self.count < 1:
            raise ValueError(f"histogram bins must be >= 1, got {self.count}")
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)) or self.lo >= self.hi:
            raise ValueError(
                f"histogram range must be finite with lo < hi, got ({self.lo}, {self.hi})"
            )

    def spec(self) -> list[float]:
        """[lo, hi, count], the JSON form stored in meta["edges"]."""
        return [float(self.lo), float(self.hi), self.count]


def symmetric_bins(count: int, abs_max: float) -> Bins:
    """Bins on [−abs_max, abs_max] (the "adaptive" range); [−0.5, 0.5] when abs_max is 0,
    as numpy does for an empty range."""
    return Bins(count, -abs_max, abs_max) if abs_max > 0 else Bins(count, -0.5, 0.5)


@dataclass
class Histogram:
    """Counts of one histogram, plus its out-of-range and non-finite counts.

    counts: int64, (bins,) for GradHist1d; (param bins, grad bins) for GradHist2d.
    extras: GradHist1d: underflow, overflow, nan, posinf, neginf. GradHist2d: the same for
            pairs whose θ is in range, by their gradient value; plus param_underflow,
            param_overflow, param_nonfinite for pairs whose θ is out of range or not
            finite (any gradient). Every element / pair is counted exactly once.
    edges:  [lo, hi, bins] per axis: a flat list (1-D) or one list per axis (2-D).
    """

    counts: np.ndarray
    extras: dict[str, int]
    edges: list[Any]

    def __add__(self, other: Histogram) -> Histogram:
        if self.edges != other.edges:
            raise ValueError(f"cannot add histograms with edges {self.edges} and {other.edges}")
        extras = {key: self.extras[key] + other.extras[key] for key in self.extras}
        return Histogram(self.counts + other.counts, extras, self.edges)

    def meta(self) -> dict[str, Any]:
        """JSON-serialisable meta for storage: {"edges": ..., **extras}."""
        return {"edges": self.edges, **self.extras}


@dataclass
class _Axis:
    """`Bins` prepared for one dtype and device."""

    bins: Bins
    edges: Tensor  # (count + 1,) in the work dtype
    zone: tuple[float, float]  # values strictly inside are binned by sign alone
    sign_classes: list[int] = field(default_factory=list)  # class of negative, zero, positive

    @classmethod
    def build(cls, bins: Bins, dtype: torch.dtype, device: torch.device) -> _Axis:
        np_dtype = np.float64 if dtype == torch.float64 else np.float32
        edges = np.linspace(bins.lo, bins.hi, bins.count + 1, endpoint=True, dtype=np_dtype)
        negative, positive = edges[edges < 0], edges[edges > 0]
        low = float(negative.max()) if negative.size else -math.inf
        high = float(positive.min()) if positive.size else math.inf
        axis = cls(bins, torch.from_numpy(edges).to(device), (low, high))
        # halving an edge stays strictly between it and 0, so it stands for the whole side
        probes = [low / 2 if negative.size else -1.0, 0.0, high / 2 if positive.size else 1.0]
        axis.sign_classes = axis.classify(torch.tensor(probes, dtype=dtype, device=device)).tolist()
        return axis

    def classify(self, x: Tensor) -> Tensor:
        """Class of each value: bin index, or count + (0 under, 1 over, 2 NaN, 3 +Inf, 4 −Inf)."""
        n = self.bins.count
        index = torch.bucketize(x, self.edges, right=True) - 1  # #edges <= x, minus 1
        index = torch.where(x == self.edges[-1], n - 1, index)  # the last bin is closed
        index = torch.where(index < 0, n + _UNDER, torch.where(index >= n, n + _OVER, index))
        index = torch.where(x.isnan(), n + _NAN, index)
        index = torch.where(x == math.inf, n + _POSINF, index)
        return torch.where(x == -math.inf, n + _NEGINF, index)


@functools.lru_cache(maxsize=64)
def _axis(bins: Bins, dtype: torch.dtype, device: torch.device) -> _Axis:
    """The prepared axis, built once per (bins, dtype, device)."""
    return _Axis.build(bins, dtype, device)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    if not dtype.is_floating_point:
        raise TypeError(f"histograms need floating-point gradients, got dtype {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def _outer_positions(flat: Tensor, low: float, high: float, has_nan: bool) -> Tensor:
    """Indices into `flat` (n,) of the values outside the open zone (low, high), and NaNs.

    Outer values are usually rare, and locating them element by element is the slow part,
    so blocks of `_BLOCK` values are screened by their min / max first.
    """
    def scan(x: Tensor) -> Tensor:
        outer = ~((x > low) & (x < high)) if has_nan else (x >= high) | (x <= low)
        return outer.nonzero().squeeze(1)

    n_blocks = flat.numel() // _BLOCK
    if has_nan or n_blocks == 0:  # NaN escapes the block min / max screen
        return scan(flat)
    head = flat[: n_blocks * _BLOCK].view(n_blocks, _BLOCK)
    flagged = ((head.amax(1) >= high) | (head.amin(1) <= low)).nonzero().squeeze(1)
    if 4 * flagged.numel() > n_blocks:  # dense outliers: one scan of everything is cheaper
        return scan(flat)
    inside = scan(head[flagged].view(-1))
    found = flagged[inside // _BLOCK] * _BLOCK + inside % _BLOCK
    return torch.cat([found, scan(flat[n_blocks * _BLOCK :]) + n_blocks * _BLOCK])


def _grouped_counts(
    grads: Tensor, axis: _Axis, groups: Tensor | None, n_groups: int
) -> Tensor:
    """Class counts of every element of `grads` (rows, D), per group of columns.

    groups: (D,) group index of each column in [0, n_groups), or None for one group.
    Returns (n_groups, bins + 5) float64 counts on the device (exact integers).
    """
    rows_total, width = grads.shape
    device = grads.device
    budget = _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS_OTHER)
    rows = max(1, min(rows_total, budget // max(width, 1)))
    low, high = axis.zone
    # Σ sign and Σ sign² of the inner values: per column when grouped, else in total. Sums of
    # ±1 and 0 are exact in float32 up to 2^24 terms (a chunk, or B per column).
    shape = (width,) if groups is not None else ()
    signed = torch.zeros(shape, dtype=torch.float64, device=device)
    nonzero = torch.zeros(shape, dtype=torch.float64, device=device)
    buffer = torch.empty(rows * width, dtype=grads.dtype, device=device)
    outer_classes, outer_columns = [], []
    for start in range(0, rows_total, rows):
        chunk = grads[start : start + rows]
        flat = chunk.reshape(-1)
        signs = torch.sign(flat, out=buffer[: flat.numel()])
        smallest, largest = (v.item() for v in torch.aminmax(flat))
        if not low < smallest <= largest < high:  # some outer value (False with NaN too)
            where = _outer_positions(flat, low, high, math.isnan(smallest))
            outer_classes.append(axis.classify(flat[where]))
            outer_columns.append(where % width)
            signs[where] = 0
        if groups is None:
            signed += signs.sum()
            nonzero += torch.dot(signs, signs)
        else:
            signs = signs.view(chunk.shape)
            signed += signs.sum(0)
            nonzero += signs.abs_().sum(0)

    n_classes = axis.bins.count + len(EXTRAS)
    no_outer = torch.zeros(0, dtype=torch.long, device=device)
    columns = torch.cat(outer_columns) if outer_columns else no_outer
    classes = torch.cat(outer_classes) if outer_classes else no_outer
    if groups is None:
        counts = torch.bincount(classes, minlength=n_classes).double()[None]
        inner = torch.tensor(float(rows_total * width - columns.numel()), dtype=torch.float64,
                             device=device)
        s, a, total = (t.reshape(1) for t in (signed, nonzero, inner))
    else:
        counts = torch.bincount(
            groups[columns] * n_classes + classes, minlength=n_groups * n_classes
        ).double().view(n_groups, n_classes)
        inner = rows_total - torch.bincount(columns, minlength=width).double()
        s, a, total = torch.zeros(3, n_groups, dtype=torch.float64, device=device).index_add_(
            1, groups, torch.stack([signed, nonzero, inner]))
    negative, zero, positive = (a - s) / 2, total - a, (a + s) / 2
    for cls, part in zip(axis.sign_classes, (negative, zero, positive)):
        counts[:, cls] += part
    return counts


def _flat_rows(grads: Tensor) -> Tensor:
    """(B, *shape) -> (B, D) in the work dtype, without a copy when possible."""
    return grads.reshape(grads.shape[0], -1).to(_work_dtype(grads.dtype))


def _split_extras(row: Tensor, count: int, prefix: str = "") -> dict[str, int]:
    return {prefix + key: int(v) for key, v in zip(EXTRAS, row[count:].tolist())}


def histogram_1d(grads: Tensor, bins: Bins) -> Histogram:
    """GradHist1d of one tensor of per-sample gradients: every element counted once.

    Args:
        grads: (B, *param.shape) per-sample gradients gᵢ (any float dtype, any device).
        bins: the axis (default in the suite: 100 bins on [−2, 2]).

    Returns:
        Histogram with (bins,) int64 counts and the five extras.
    """
    flat = _flat_rows(grads)
    row = _grouped_counts(flat, _axis(bins, flat.dtype, flat.device), None, 1)[0].cpu()
    counts = row[: bins.count].numpy().astype(np.int64)
    return Histogram(counts, _split_extras(row, bins.count), bins.spec())


def histogram_2d(params: Tensor, grads: Tensor, param_bins: Bins, grad_bins: Bins) -> Histogram:
    """GradHist2d: pairs (θₐ, gᵢ,ₐ) over all samples i and elements a of one tensor.

    Args:
        params: θ, the parameter values the gradients were taken at (before the update).
        grads: (B, *params.shape) per-sample gradients.
        param_bins, grad_bins: the two axes (suite default: 40 on [−1, 1], 50 on [−2, 2]).

    Returns:
        Histogram with (param bins, grad bins) int64 counts; extras as documented there.

    Raises:
        ValueError: if the shapes do not match.
    """
    if tuple(grads.shape[1:]) != tuple(params.shape):
        raise ValueError(
            f"grads must have shape (B, *{tuple(params.shape)}), got {tuple(grads.shape)}"
        )
    flat = _flat_rows(grads)
    groups = _axis(param_bins, flat.dtype, flat.device).classify(params.reshape(-1).to(flat))
    n_param = param_bins.count + len(EXTRAS)
    table = _grouped_counts(flat, _axis(grad_bins, flat.dtype, flat.device), groups,
                            n_param).cpu()
    px, gy = param_bins.count, grad_bins.count
    inside = table[:px]
    extras = _split_extras(inside.sum(0), gy)
    outside = table[px:].sum(1).tolist()  # pairs by θ's class
    extras["param_underflow"] = int(outside[_UNDER])
    extras["param_overflow"] = int(outside[_OVER])
    extras["param_nonfinite"] = int(sum(outside[_NAN:]))
    counts = inside[:, :gy].numpy().astype(np.int64)
    return Histogram(counts, extras, [param_bins.spec(), grad_bins.spec()])


def finite_abs_max(t: Tensor) -> float:
    """max |x| over the finite elements of t (0.0 if there are none); for "adaptive" ranges."""
    smallest, largest = torch.aminmax(t.reshape(-1))
    bound = max(abs(smallest.item()), abs(largest.item()))
    if math.isfinite(bound):
        return bound
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0
