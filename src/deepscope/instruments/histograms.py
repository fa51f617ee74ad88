"""Exact histograms of per-sample gradient elements (GradHist1d) and of (θₐ, gᵢ,ₐ) pairs
(GradHist2d), computed on the tensors' device part by part (consecutive samples) and sent
to the host once, at the end.

Binning is numpy.histogram's with ``range=(lo, hi)`` on the data's own dtype: edges
``np.linspace(lo, hi, bins + 1, dtype=<data dtype>)``, bin k holds e_k <= x < e_{k+1}, the
last bin also holds x = hi. float16 / bfloat16 data are binned as float32 (exact upcast).
Unlike Cockpit, nothing is clamped into the edge bins: finite values below lo / above hi
are counted as underflow / overflow, and NaN, +Inf, -Inf separately.

Why it is fast: per-sample gradient elements are overwhelmingly small, and every value
strictly between the nearest negative and the nearest positive edge falls into a bin
fixed by its sign alone. So most elements are only counted by sign, and only the rest
("outer" elements) are binned individually; materialised parts (a few vectorised passes
over cache-sized chunks) are counted so. Outer-product parts (`RankOne`: Linear layers)
are never materialised. The signs of products follow from the signs of their factors;
and since rounding is monotone, the products of one factor with a sorted row are sorted:
#{products >= e} is a cut found by binary search, for only the rows (i, o) whose largest
product reaches e. GradHist1d needs just those counts per edge; GradHist2d forms exactly
the outer products (a suffix of each sorted row) to bin them with their θ. The cost then
grows with the rows and outer elements, not with B·D. Parts where that would cost more
(most values outer) are materialised and every value is classed directly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .rules.base import Part, RankOne

# extra classes after the `bins` regular ones, in this order
EXTRAS: tuple[str, ...] = ("underflow", "overflow", "nan", "posinf", "neginf")
_UNDER, _OVER, _NAN, _POSINF, _NEGINF = range(len(EXTRAS))
# elements per chunk: about 4 MB of float32 on CPU keeps each chunk's passes in cache;
# on an accelerator fewer, bigger chunks mean fewer host synchronisations.
_CHUNK_ELEMENTS = {"cpu": 1 << 20}
_CHUNK_ELEMENTS_OTHER = 1 << 24
_BLOCK = 128  # values per block when screening a chunk for outer values
# every this many values, one is looked at to tell whether most values are outer; above
# this fraction they are all classed directly
_SAMPLE_STRIDE = 61
_DENSE = 0.25
# rank-one parts are materialised when the per-edge searches (1-D) / the outer products
# (2-D) would be more than this fraction of the number of products
_CUT_WORK = 0.5
_SCREEN_WORK = 0.25


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


def _outer_positions(flat: Tensor, low: float, high: float, has_nan: bool) -> Tensor | None:
    """Indices into `flat` (n,) of the values outside the open zone (low, high), and NaNs;
    None when they are so many that classing every value directly is cheaper.

    Outer values are usually rare, and locating them element by element is the slow part,
    so blocks of `_BLOCK` values are screened by their min / max first.
    """
    def scan(x: Tensor) -> Tensor:
        outer = ~((x > low) & (x < high)) if has_nan else (x >= high) | (x <= low)
        return outer.nonzero().squeeze(1)

    sample = flat[:: _SAMPLE_STRIDE]
    if bool((~((sample > low) & (sample < high))).sum() > _DENSE * sample.numel()):
        return None
    n_blocks = flat.numel() // _BLOCK
    if has_nan or n_blocks == 0:  # NaN escapes the block min / max screen
        return scan(flat)
    head = flat[: n_blocks * _BLOCK].view(n_blocks, _BLOCK)
    flagged = ((head.amax(1) >= high) | (head.amin(1) <= low)).nonzero().squeeze(1)
    if 4 * flagged.numel() > n_blocks:  # many blocks: one scan of everything is cheaper
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
    n_classes = axis.bins.count + len(EXTRAS)
    counts = torch.zeros(n_groups * n_classes, dtype=torch.float64, device=device)
    # Σ sign and Σ sign² of the inner values: per column when grouped, else in total. Sums of
    # ±1 and 0 are exact in float32 up to 2^24 terms (a chunk, or B per column).
    shape = (width,) if groups is not None else ()
    signed = torch.zeros(shape, dtype=torch.float64, device=device)
    nonzero = torch.zeros(shape, dtype=torch.float64, device=device)
    buffer = torch.empty(rows * width, dtype=grads.dtype, device=device)
    by_sign = 0  # rows counted by sign
    outer_columns = []
    for start in range(0, rows_total, rows):
        chunk = grads[start : start + rows]
        flat = chunk.reshape(-1)
        smallest, largest = (v.item() for v in torch.aminmax(flat))
        where = None
        if not low < smallest <= largest < high:  # some outer value (False with NaN too)
            where = _outer_positions(flat, low, high, math.isnan(smallest))
            values = flat if where is None else flat.index_select(0, where)
            columns = None if where is None else where % width
            key = axis.classify(values)
            if groups is not None:
                key = (key.view(chunk.shape) + groups * n_classes if columns is None
                       else key + groups.index_select(0, columns) * n_classes)
            counts += torch.bincount(key.reshape(-1), minlength=n_groups * n_classes)
            if columns is None:
                continue  # every value classed: none is left to count by sign
            outer_columns.append(columns)
        by_sign += chunk.shape[0]
        signs = torch.sign(flat, out=buffer[: flat.numel()])
        if where is not None:
            signs[where] = 0
        if groups is None:
            signed += signs.sum()
            nonzero += torch.dot(signs, signs)
        else:
            signs = signs.view(chunk.shape)
            signed += signs.sum(0)
            nonzero += signs.abs_().sum(0)

    counts = counts.view(n_groups, n_classes)
    columns = (torch.cat(outer_columns) if outer_columns
               else torch.zeros(0, dtype=torch.long, device=device))
    if groups is None:
        inner = torch.tensor(float(by_sign * width - columns.numel()), dtype=torch.float64,
                             device=device)
        s, a, total = (t.reshape(1) for t in (signed, nonzero, inner))
    else:
        inner = by_sign - torch.bincount(columns, minlength=width).double()
        s, a, total = torch.zeros(3, n_groups, dtype=torch.float64, device=device).index_add_(
            1, groups, torch.stack([signed, nonzero, inner]))
    negative, zero, positive = (a - s) / 2, total - a, (a + s) / 2
    for cls, part in zip(axis.sign_classes, (negative, zero, positive)):
        counts[:, cls] += part
    return counts


# A rounded product with |value| >= t has |exact product| >= t·(1 − 2⁻²³) (float32, and
# float64 a fortiori); screening with this much less keeps every such product, through the
# rounding of the screening products themselves and of the threshold to the data's dtype.
_SCREEN_SLACK = 1 - 2.0**-18


def _factors_usable(part: RankOne) -> bool:
    """Whether sign counts of `part`'s products follow from its factors' signs and every
    product is finite: float32 / float64 factors (half-precision products round in half),
    all finite, no nonzero product small enough to round to zero, none large enough to
    round to ±Inf. Also False for more than 2²⁴ samples (sign sums in float32)."""
    left, right = part.left, part.right
    if left.dtype not in (torch.float32, torch.float64) or part.samples > 2**24:
        return False
    if left.numel() == 0 or right.numel() == 0:
        return True
    a_left, a_right = left.abs(), right.abs()
    big = left.new_tensor(math.inf)
    largest_l, largest_r, smallest_l, smallest_r = torch.stack([
        a_left.max(), a_right.max(),
        torch.where(a_left > 0, a_left, big).min(), torch.where(a_right > 0, a_right, big).min(),
    ]).tolist()
    info = torch.finfo(left.dtype)
    return (math.isfinite(largest_l) and math.isfinite(largest_r)  # no NaN, no ±Inf
            and smallest_l * smallest_r >= info.tiny
            and largest_l * largest_r <= info.max * _SCREEN_SLACK)


@dataclass
class _SortedRows:
    """Each sample's `right` row sorted ascending, for counting the products fl(f·r) >= t
    of a factor f with a row exactly: fl(|f|·r) grows with r, so the count is a cut in the
    sorted row, found by binary search on the rounded products themselves; a negative
    factor counts from the other end (fl(−a·r) = −fl(a·r)).

    table: (b, 2**span) flat, each row ascending, padded with +Inf so that a search never
    leaves its row.  order: (b, width) original column of each sorted position (only when
    asked for).
    """

    table: Tensor
    span: int
    width: int
    samples: int
    order: Tensor | None

    @classmethod
    def build(cls, right: Tensor, with_order: bool) -> _SortedRows:
        b, width = right.shape
        if right.device.type == "cpu":  # numpy's sorts are several times faster on CPU
            rows = right.numpy()
            order_np = np.argsort(rows, axis=1) if with_order else None
            ascending = torch.from_numpy(np.take_along_axis(rows, order_np, 1)
                                         if order_np is not None else np.sort(rows, axis=1))
            order = torch.from_numpy(order_np) if order_np is not None else None
        else:
            ascending, order = torch.sort(right, dim=1)
            order = order if with_order else None
        span = max(1, width).bit_length()  # 2**span > width
        table = torch.full((b, 1 << span), math.inf, dtype=right.dtype, device=right.device)
        table[:, :width] = ascending
        return cls(table.reshape(-1), span, width, b, order)

    def signs(self) -> tuple[Tensor, Tensor]:
        """(#negative, #positive) values per sample (b,), from the sorted rows."""
        ascending = self.table.view(self.samples, -1)
        zero = ascending.new_zeros(self.samples, 1)
        negative = torch.searchsorted(ascending, zero)[:, 0]
        return negative, self.width - torch.searchsorted(ascending, zero, right=True)[:, 0]

    def count(self, sample: Tensor, factor: Tensor, threshold: Tensor, flip: Tensor
              ) -> tuple[Tensor, Tensor]:
        """(#{r in row: fl(f'·r) >= threshold}, mirrored) per query, f' = −factor where
        `flip`, else factor (factor nonzero, threshold > 0). Mirrored (f' < 0): the count
        is a prefix of the ascending row, else a suffix."""
        mirrored = (factor < 0) ^ flip
        # with a = |f'|: f' > 0 counts the rest of #{fl(a·r) < t}; f' < 0 (fl(f'·r) =
        # −fl(a·r)) counts #{fl(a·r) <= −t} = #{fl(a·r) < next float above −t}
        bound = torch.where(mirrored, torch.nextafter(-threshold, threshold.new_tensor(math.inf)),
                            threshold)
        cursor = sample * (1 << self.span) - 1
        start = cursor.clone()
        a = factor.abs()
        # binary lifting; index_select: several times faster than indexing with [] on CPU
        for step in (1 << k for k in range(self.span - 1, -1, -1)):
            candidate = cursor + step
            cursor = torch.where(a * self.table.index_select(0, candidate) < bound,
                                 candidate, cursor)
        below = cursor - start
        return torch.where(mirrored, below, self.width - below), mirrored


def _rank_one_1d(part: RankOne, axis: _Axis) -> Tensor | None:
    """GradHist1d class counts (1, bins + 5) of a `RankOne` part's products, float64 on
    the device, from counts per edge instead of per product; None when not applicable
    (see `_factors_usable`) or when classing the products one by one is cheaper.

    For an edge e > 0, #{products >= e} is a sum over rows (i, o) of `_SortedRows.count`;
    only rows with |left[i, o]|·max|right[i]| >= e can reach e. For e < 0, #{products < e}
    = #{fl(−left·right) > |e|}; for e = 0 the sign counts. Bin k is then #{>= e_k} −
    #{>= e_k+1}.
    """
    if not _factors_usable(part):
        return None
    left, right = part.left, part.right
    if left.shape[1] > right.shape[1]:  # search the longer side: fewer rows
        left, right = right, left
    b, rows_per_sample = left.shape
    width = right.shape[1]
    device = left.device
    total = b * rows_per_sample * width
    query = axis.queries
    n = axis.bins.count
    if total == 0:
        return torch.zeros(1, n + len(EXTRAS), dtype=torch.float64, device=device)
    # the queries each row can reach: sorted thresholds <= |left|·max|right| (with slack);
    # most rows reach none
    reach = (left.abs() * right.abs().amax(1, keepdim=True)).reshape(-1)
    limits = query.threshold * _SCREEN_SLACK
    rows = (reach >= limits[0]).nonzero().squeeze(1)
    per_row = torch.searchsorted(limits, reach[rows], right=True)
    pairs = int(per_row.sum())
    if pairs * (width.bit_length() + 4) > total * _CUT_WORK:  # classing each is cheaper
        return None
    taken = torch.repeat_interleave(torch.arange(rows.numel(), device=device), per_row,
                                    output_size=pairs)
    row = rows.index_select(0, taken)
    entry = (torch.arange(pairs, device=device)
             - (torch.cumsum(per_row, 0) - per_row).index_select(0, taken))
    sorted_rows = _SortedRows.build(right, with_order=False)
    found, _ = sorted_rows.count(row // rows_per_sample, left.reshape(-1).index_select(0, row),
                                 query.threshold.index_select(0, entry),
                                 query.flip.index_select(0, entry))
    reached = torch.zeros(query.threshold.numel(), dtype=torch.float64, device=device)
    reached.index_add_(0, entry, found.double())
    # #{products >= e_k} for k = 0..n, then #{products > e_n}, from the reached counts
    nr, pr = sorted_rows.signs()
    pl, nl = (left > 0).sum(1), (left < 0).sum(1)
    positive = float((pl * pr + nl * nr).sum())  # a product's sign: its factors' signs
    negative = float((pl * nr + nl * pr).sum())
    at_least = torch.zeros(n + 2, dtype=torch.float64, device=device)
    at_least.index_add_(0, query.slot, reached)
    at_least = torch.where(query.complement, total - at_least, at_least)
    at_least[query.zero_slots] = total - negative  # e = 0: everything not negative
    if query.last_is_zero:
        at_least[n + 1] = positive  # #{products > 0}
    counts = torch.zeros(1, n + len(EXTRAS), dtype=torch.float64, device=device)
    counts[0, :n] = at_least[:n] - at_least[1 : n + 1]
    counts[0, n - 1] = at_least[n - 1] - at_least[n + 1]  # the last bin is closed
    counts[0, n + _UNDER] = total - at_least[0]
    counts[0, n + _OVER] = at_least[n + 1]
    return counts


def _rank_one_2d(part: RankOne, axis: _Axis, groups: Tensor, n_groups: int) -> Tensor | None:
    """GradHist2d class counts (n_groups, bins + 5) of a `RankOne` part's products, float64
    on the device, without forming them; None when not applicable (see `_factors_usable`)
    or when most products are outer (then classing all of them is cheaper).

    Inner products are counted by sign, per element a from two matmuls of the factors'
    sign matrices over the samples (a product of such factors has their signs' product).
    The outer ones of a row (i, o), fl(left·right) >= high or <= low, are the last
    `_SortedRows.count` entries of right[i] sorted or mirrored: exactly those are formed
    and binned one by one with their θ group.
    """
    if not _factors_usable(part):
        return None
    left, right = part.left, part.right
    b, width_o = left.shape
    width_i = right.shape[1]
    n_classes = axis.bins.count + len(EXTRAS)
    device = left.device
    counts = torch.zeros(n_groups * n_classes, dtype=torch.float64, device=device)
    if left.numel() == 0 or right.numel() == 0:
        return counts.view(n_groups, n_classes)
    low, high = axis.zone
    # queries (row, side) for the finite zone bounds: hi fl(left·r) >= high, lo
    # fl(−left·r) >= −low; only rows whose largest product can reach the bound
    reach = (left.abs() * right.abs().amax(1, keepdim=True)).reshape(-1)
    rows, flips, thresholds = [], [], []
    for bound, flipped in ((high, False), (-low, True)):
        if math.isfinite(bound):
            reaching = (reach >= bound * _SCREEN_SLACK).nonzero().squeeze(1)
            rows.append(reaching)
            flips.append(torch.full(reaching.shape, flipped, device=device))
            thresholds.append(left.new_full(reaching.shape, bound))
    row, flip, threshold = torch.cat(rows), torch.cat(flips), torch.cat(thresholds)
    sorted_rows = _SortedRows.build(right, with_order=True)
    order = sorted_rows.order
    assert order is not None  # asked for
    sample = row // width_o
    found, mirrored = sorted_rows.count(sample, left.reshape(-1).index_select(0, row),
                                        threshold, flip)
    hits = int(found.sum())
    if hits > b * width_o * width_i * _SCREEN_WORK:  # mostly outer: class them all
        return None

    sl, sr = left.sign(), right.sign()
    agree, nonzero = sl.T @ sr, sl.abs().T @ sr.abs()  # Σᵢ of ±1 / 0: exact integers
    s, a = (torch.bincount(groups, weights=t.reshape(-1).double(), minlength=n_groups)
            for t in (agree, nonzero))
    elements = torch.bincount(groups, minlength=n_groups).double()
    sides = torch.stack([(a - s) / 2, b * elements - a, (a + s) / 2])  # −, 0, + per group

    # the hits: the last `found` positions of each query's row, ascending or mirrored (−r
    # reversed: the first `found` ascending); hit k of query q sits at
    # width − found[q] + (k − first hit of q) = width + k − cumsum[q]
    query = torch.repeat_interleave(torch.arange(found.numel(), device=device), found,
                                    output_size=hits)
    position = (torch.arange(hits, device=device)
                - (torch.cumsum(found, 0) - width_i).index_select(0, query))
    position = torch.where(mirrored.index_select(0, query), width_i - 1 - position, position)
    i, flat_row = sample.index_select(0, query), row.index_select(0, query)
    j = order.reshape(-1).index_select(0, i * width_i + position)
    # rounded as materialised
    values = (left.reshape(-1).index_select(0, flat_row)
              * right.reshape(-1).index_select(0, i * width_i + j))
    group = groups.index_select(0, (flat_row % width_o) * width_i + j)
    counts += torch.bincount(group * n_classes + axis.classify(values),
                             minlength=n_groups * n_classes)
    # binned here, so not by sign: 0 negative, 2 positive (outer values are never zero)
    side = (values > 0).long() * 2 * n_groups + group
    sides -= torch.bincount(side, minlength=3 * n_groups).view(3, n_groups)
    counts = counts.view(n_groups, n_classes)
    for cls, part_count in zip(axis.sign_classes, sides):
        counts[:, cls] += part_count
    return counts


def _flat_rows(grads: Tensor) -> Tensor:
    """(B, *shape) -> (B, D) in the work dtype, without a copy when possible."""
    return grads.reshape(grads.shape[0], -1).to(_work_dtype(grads.dtype))


def _materialised(part: Part) -> Iterator[Tensor]:
    """A part as (b, D) tensors of consecutive samples, at most a chunk's worth at a time."""
    if isinstance(part, Tensor):
        yield part
        return
    elements = part.left.shape[1] * part.right.shape[1]
    budget = _CHUNK_ELEMENTS.get(part.left.device.type, _CHUNK_ELEMENTS_OTHER)
    rows = max(1, budget // max(elements, 1))
    for lo in range(0, part.samples, rows):
        yield part.materialise(lo, min(lo + rows, part.samples))


def _split_extras(row: Tensor, count: int, prefix: str = "") -> dict[str, int]:
    return {prefix + key: int(v) for key, v in zip(EXTRAS, row[count:].tolist())}


class GradHistogram:
    """GradHist1d counts of one tensor's per-sample gradients, or GradHist2d counts with
    the tensor's values θ, added part by part (consecutive samples of any split).

    Args:
        bins: the gradient axis (suite default: 100 bins on [−2, 2]; 2-D: 50 on [−2, 2]).
        params: θ, for GradHist2d: the parameter values the gradients were taken at.
        param_bins: the θ axis for GradHist2d (suite default: 40 on [−1, 1]).
    """

    def __init__(
        self, bins: Bins, params: Tensor | None = None, param_bins: Bins | None = None
    ) -> None:
        if (params is None) != (param_bins is None):
            raise ValueError("GradHist2d needs both params and param_bins")
        self.bins = bins
        self.params = params
        self.param_bins = param_bins
        self._counts: Tensor | None = None
        self._groups: Tensor | None = None

    def add(self, part: Part) -> None:
        """Count one part: a (b, *params.shape) tensor or a `RankOne` (any float dtype).

        Raises:
            TypeError: for integer gradients.  ValueError: (2-D) for a shape mismatch.
        """
        work = _work_dtype(part.dtype)
        device = part.left.device if isinstance(part, RankOne) else part.device
        axis = _axis(self.bins, work, device)
        groups, n_groups = None, 1
        if self.params is not None and self.param_bins is not None:
            self._check_shape(part)
            if self._groups is None:
                values = self.params.reshape(-1).to(device=device, dtype=work)
                self._groups = _axis(self.param_bins, work, device).classify(values)
            groups, n_groups = self._groups, self.param_bins.count + len(EXTRAS)
        counts = None
        if isinstance(part, RankOne):
            counts = (_rank_one_1d(part, axis) if groups is None
                      else _rank_one_2d(part, axis, groups, n_groups))
        if counts is None:
            for chunk in _materialised(part):
                more = _grouped_counts(_flat_rows(chunk), axis, groups, n_groups)
                counts = more if counts is None else counts + more
        if counts is not None:
            self._counts = counts if self._counts is None else self._counts + counts

    def _check_shape(self, part: Part) -> None:
        assert self.params is not None
        shape = tuple(self.params.shape)
        if isinstance(part, RankOne):
            ok = part.left.shape[1] * part.right.shape[1] == self.params.numel()
            got = f"a rank-one part of {part.left.shape[1]}×{part.right.shape[1]}"
        else:
            ok = tuple(part.shape[1:]) == shape
            got = str(tuple(part.shape))
        if not ok:
            raise ValueError(f"grads must have shape (B, *{shape}), got {got}")

    def result(self) -> Histogram:
        """The counts so far (one transfer to the host).

        Raises:
            ValueError: if nothing was added.
        """
        if self._counts is None:
            raise ValueError("no per-sample gradients were added to the histogram")
        table = self._counts.cpu()
        gy = self.bins.count
        if self.param_bins is None:
            row = table[0]
            counts = row[:gy].numpy().astype(np.int64)
            return Histogram(counts, _split_extras(row, gy), self.bins.spec())
        px = self.param_bins.count
        inside = table[:px]
        extras = _split_extras(inside.sum(0), gy)
        outside = table[px:].sum(1).tolist()  # pairs by θ's class
        extras["param_underflow"] = int(outside[_UNDER])
        extras["param_overflow"] = int(outside[_OVER])
        extras["param_nonfinite"] = int(sum(outside[_NAN:]))
        counts = inside[:, :gy].numpy().astype(np.int64)
        return Histogram(counts, extras, [self.param_bins.spec(), self.bins.spec()],
                         _clamped(table.numpy(), px, gy))


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


def _parts(grads: Part | Iterable[Part]) -> Iterable[Part]:
    return [grads] if isinstance(grads, (Tensor, RankOne)) else grads


def histogram_1d(grads: Part | Iterable[Part], bins: Bins) -> Histogram:
    """GradHist1d of one tensor of per-sample gradients: every element counted once.

    Args:
        grads: (B, *param.shape) per-sample gradients gᵢ (any float dtype, any device), a
            `RankOne` factorisation of them, or an iterable of such parts.
        bins: the axis (default in the suite: 100 bins on [−2, 2]).

    Returns:
        Histogram with (bins,) int64 counts and the five extras.
    """
    hist = GradHistogram(bins)
    for part in _parts(grads):
        hist.add(part)
    return hist.result()


def histogram_2d(
    params: Tensor, grads: Part | Iterable[Part], param_bins: Bins, grad_bins: Bins
) -> Histogram:
    """GradHist2d: pairs (θₐ, gᵢ,ₐ) over all samples i and elements a of one tensor.

    Args:
        params: θ, the parameter values the gradients were taken at (before the update).
        grads: (B, *params.shape) per-sample gradients, a `RankOne`, or an iterable of parts.
        param_bins, grad_bins: the two axes (suite default: 40 on [−1, 1], 50 on [−2, 2]).

    Returns:
        Histogram with (param bins, grad bins) int64 counts; extras as documented there.

    Raises:
        ValueError: if the shapes do not match.
    """
    hist = GradHistogram(grad_bins, params, param_bins)
    for part in _parts(grads):
        hist.add(part)
    return hist.result()


def finite_abs_max(grads: Part | Iterable[Part]) -> float:
    """max |x| over the finite elements (0.0 if there are none); for "adaptive" ranges."""
    return max((_part_abs_max(part) for part in _parts(grads)), default=0.0)


def _part_abs_max(part: Part) -> float:
    if isinstance(part, RankOne):
        if part.left.numel() == 0 or part.right.numel() == 0:
            return 0.0
        # |fl(a·b)| grows with |a| and |b|: the largest product is that of the maxima
        bound = float((part.left.abs().amax(1) * part.right.abs().amax(1)).max())
        if math.isfinite(bound):
            return bound
        return max(_part_abs_max(chunk) for chunk in _materialised(part))
    if part.numel() == 0:
        return 0.0
    smallest, largest = torch.aminmax(part.reshape(-1))
    bound = max(abs(smallest.item()), abs(largest.item()))
    if math.isfinite(bound):
        return bound
    finite = part[torch.isfinite(part)]
    return float(finite.abs().max()) if finite.numel() else 0.0
