"""The histogram axes and the stored format.

Binning is numpy.histogram's with ``range=(lo, hi)`` on the data's own dtype: edges
``np.linspace(lo, hi, bins + 1, dtype=<data dtype>)``, bin k holds e_k <= x < e_{k+1}, the
last bin also holds x = hi. float16 / bfloat16 data are binned as float32 (exact upcast).
Unlike Cockpit, nothing is clamped into the edge bins: finite values below lo / above hi
are counted as underflow / overflow, and NaN, +Inf, -Inf separately.

`Bins` is an axis, `Histogram` a result with its stored meta; `_Axis` is an axis prepared
for one dtype and device: the class of each value, and the per-edge queries of the
rank-one counter.
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
    clamped: GradHist2d: {(param bin, grad bin): n}, the pairs outside the ranges that
            Cockpit would count in that edge bin (out-of-range and infinite values clamped
            to the nearest bin on each axis, NaN dropped); stored as meta["clamped"].
    """

    counts: np.ndarray
    extras: dict[str, int]
    edges: list[Any]
    clamped: dict[tuple[int, int], int] = field(default_factory=dict)

    def __add__(self, other: Histogram) -> Histogram:
        if self.edges != other.edges:
            raise ValueError(f"cannot add histograms with edges {self.edges} and {other.edges}")
        extras = {key: self.extras[key] + other.extras[key] for key in self.extras}
        clamped = dict(self.clamped)
        for cell, n in other.clamped.items():
            clamped[cell] = clamped.get(cell, 0) + n
        return Histogram(self.counts + other.counts, extras, self.edges, clamped)

    def meta(self) -> dict[str, Any]:
        """JSON-serialisable meta for storage: {"edges": ..., **extras} (2-D with outside
        pairs: also "clamped": [[param bin, grad bin, n], ...])."""
        meta: dict[str, Any] = {"edges": self.edges, **self.extras}
        if self.clamped:
            meta["clamped"] = [[j, i, n] for (j, i), n in sorted(self.clamped.items())]
        return meta


@dataclass
class _Queries:
    """Per edge e_k (k = 0..n) and for "> e_n" (slot n + 1), what to count to get
    #{x >= e_k} and #{x > e_n} over products x: #{fl(a·r) >= threshold} with a = |left|
    and r from the row, mirrored when `flip` (e < 0: #{x < e} = #{fl(−left·r) > |e|}, and
    > t is >= the next float after t). Sorted by threshold.

    slot: where each count goes (0..n + 1); complement: slots whose value is the total
    minus the count; zero_slots: edges equal to 0 (#{x >= 0} from the sign counts);
    last_is_zero: e_n = 0 (#{x > 0} from the sign counts).
    """

    threshold: Tensor
    flip: Tensor
    slot: Tensor
    complement: Tensor
    zero_slots: Tensor
    last_is_zero: bool

    @classmethod
    def build(cls, edges: Tensor) -> _Queries:
        n = edges.numel() - 1
        after = torch.nextafter(edges.abs(), edges.new_tensor(math.inf))
        thresholds, flips, slots = [], [], []
        complement = [False] * (n + 2)
        for k, e in enumerate(edges.tolist()):
            if e != 0:  # e > 0: #{x >= e};  e < 0: #{x < e} = #{fl(−left·r) >= next(|e|)}
                thresholds.append(edges[k] if e > 0 else after[k])
                flips.append(e < 0)
                slots.append(k)
                complement[k] = e < 0
        last = edges[n].item()
        if last != 0:  # e_n > 0: #{x > e_n};  e_n < 0: #{x > e_n} = total − #{fl(−·) >= |e_n|}
            thresholds.append(after[n] if last > 0 else edges[n].abs())
            flips.append(last < 0)
            slots.append(n + 1)
            complement[n + 1] = last < 0
        device = edges.device
        threshold = torch.stack(thresholds)
        order = threshold.argsort()
        return cls(
            threshold[order],
            torch.tensor(flips, device=device)[order],
            torch.tensor(slots, device=device)[order],
            torch.tensor(complement, device=device),
            (edges == 0).nonzero().squeeze(1),
            last == 0,
        )


@dataclass
class _Axis:
    """`Bins` prepared for one dtype and device."""

    bins: Bins
    edges: Tensor  # (count + 1,) in the work dtype
    zone: tuple[float, float]  # values strictly inside are binned by sign alone
    # within this many bins of an integer, (x − lo)·count/(hi − lo) may be on either side of
    # the edge it stands for (round-off, and linspace's rounding of the edges); ≥ 1/4: never
    # trust it
    margin: float
    sign_classes: list[int] = field(default_factory=list)  # class of negative, zero, positive
    bounds: Tensor = field(init=False)  # −Inf, the edges, +Inf: value k+1 bounds bin k below

    def __post_init__(self) -> None:
        infinity = self.edges.new_full((1,), math.inf)
        self.bounds = torch.cat([-infinity, self.edges, infinity])

    @classmethod
    def build(cls, bins: Bins, dtype: torch.dtype, device: torch.device) -> _Axis:
        np_dtype = np.float64 if dtype == torch.float64 else np.float32
        edges = np.linspace(bins.lo, bins.hi, bins.count + 1, endpoint=True, dtype=np_dtype)
        negative, positive = edges[edges < 0], edges[edges > 0]
        low = float(negative.max()) if negative.size else -math.inf
        high = float(positive.min()) if positive.size else math.inf
        scale = bins.count / (bins.hi - bins.lo)
        deviation = np.abs((edges.astype(np.float64) - bins.lo) * scale
                           - np.arange(bins.count + 1)).max()
        # |computed − exact position| <= 4u(|position| + |lo|·scale) for values in range
        unit = float(np.finfo(np_dtype).eps) / 2
        reach = bins.count + 2 + (abs(bins.lo) + abs(bins.hi)) * scale
        margin = float(deviation) * 1.01 + 4 * unit * reach + 1e-12
        axis = cls(bins, torch.from_numpy(edges).to(device), (low, high), margin)
        # halving an edge stays strictly between it and 0, so it stands for the whole side
        probes = [low / 2 if negative.size else -1.0, 0.0, high / 2 if positive.size else 1.0]
        axis.sign_classes = axis.classify(torch.tensor(probes, dtype=dtype, device=device)).tolist()
        return axis

    @functools.cached_property
    def queries(self) -> _Queries:
        """The counts `_rank_one_1d` takes per edge, in the work dtype."""
        return _Queries.build(self.edges)

    def classify(self, x: Tensor) -> Tensor:
        """Class of each value: bin index, or count + (0 under, 1 over, 2 NaN, 3 +Inf, 4 −Inf).

        The position (x − lo)·count/(hi − lo) gives the bin unless it lies within round-off
        of an integer (an edge) or is not finite; only those values are compared with the
        edges themselves (searching is several times slower than this arithmetic on CPU).
        """
        # NumPy on the CPU: torch's comparisons and casts there are several times slower
        numpy = x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
        guess = self._guess_numpy if numpy else self._guess_torch
        index, unsure = guess(x)
        if self.margin >= 0.25:
            unsure = torch.ones_like(unsure)
        if bool(unsure.any()):
            where = unsure.nonzero().squeeze(1)
            index[where] = self._classify_exactly(x.index_select(0, where))
        return index

    def _guess_torch(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The class from the position (x − lo)·count/(hi − lo) (int64), and where that
        guess is unsure: within the margin of an edge, or not finite."""
        n, lo = self.bins.count, self.bins.lo
        position = (x - lo).mul_(n / (self.bins.hi - lo))
        index = position.floor()
        fraction = position.sub_(index)
        # not (m <= fraction <= 1 − m): near an edge, or NaN (non-finite x)
        unsure = ~((fraction >= self.margin) & (fraction <= 1 - self.margin))
        # classes as floats (small integers, exact), in place, then one conversion: fresh
        # int64 temporaries of this size cost more than the arithmetic
        index = index.clamp_(-1, n)
        index = index.masked_fill_(index == n, n + _OVER).masked_fill_(index < 0, n + _UNDER)
        return index.long(), unsure

    def _guess_numpy(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """`_guess_torch` of a CPU tensor in NumPy: the same float operations in x's dtype."""
        n, lo, values = self.bins.count, self.bins.lo, x.detach().numpy()
        # non-finite values (and overflows) turn the fraction NaN, which compares False:
        # unsure, as in the torch guess
        with np.errstate(all="ignore"):
            position = np.subtract(values, values.dtype.type(lo))
            position *= values.dtype.type(n / (self.bins.hi - lo))
            index = np.floor(position)
            position -= index  # the fraction
            unsure = ~((position >= self.margin) & (position <= 1 - self.margin))
            np.clip(index, -1, n, out=index)
            classes = index.astype(np.int64)
        classes[classes == n] = n + _OVER
        classes[classes < 0] = n + _UNDER
        return torch.from_numpy(classes), torch.from_numpy(unsure)

    def _classify_exactly(self, x: Tensor) -> Tensor:
        """`classify` by comparing with the edges, for any values."""
        n, lo = self.bins.count, self.bins.lo
        finite = torch.where(x.isfinite(), x, 0.0)  # non-finite values are classed last
        # a guess from the equal spacing, then the position p with bounds[p] <= x <
        # bounds[p + 1] (p − 1 = #edges <= x, minus 1, as numpy)
        guess = ((finite - lo) * (n / (self.bins.hi - lo))).floor_().clamp_(-1, n)
        position = guess.long() + 1
        for _ in range(n + 2):  # off by one at most, unless edges coincide in this dtype
            step = ((finite >= self.bounds.index_select(0, position + 1)).long()
                    - (finite < self.bounds.index_select(0, position)).long())
            if not bool(step.any()):
                break
            position += step
        index = position - 1
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


def _split_extras(row: Tensor, count: int, prefix: str = "") -> dict[str, int]:
    return {prefix + key: int(v) for key, v in zip(EXTRAS, row[count:].tolist())}


def _clamped(table: np.ndarray, px: int, gy: int) -> dict[tuple[int, int], int]:
    """The outside pairs of a (px + extras, gy + extras) class table, by the edge bin
    Cockpit's clamping puts them in (see `Histogram.clamped`)."""
    def nearest(n: int) -> np.ndarray:  # class -> bin (-1: dropped)
        to = np.arange(n + len(EXTRAS))
        to[n + _UNDER] = to[n + _NEGINF] = 0
        to[n + _OVER] = to[n + _POSINF] = n - 1
        to[n + _NAN] = -1
        return to

    rows, cols = np.nonzero(table)
    outside = (rows >= px) | (cols >= gy)
    rows, cols = rows[outside], cols[outside]
    j, i = nearest(px)[rows], nearest(gy)[cols]
    kept = (j >= 0) & (i >= 0)
    clamped: dict[tuple[int, int], int] = {}
    for cell_j, cell_i, n in zip(j[kept], i[kept], table[rows[kept], cols[kept]]):
        clamped[int(cell_j), int(cell_i)] = clamped.get((int(cell_j), int(cell_i)), 0) + int(n)
    return clamped
