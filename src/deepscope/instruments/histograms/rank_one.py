"""The rank-one counter: histogram classes of outer-product parts (`RankOne`: Linear
layers) from their factors, never materialised.

The signs of products follow from the signs of their factors; and since rounding is
monotone, the products of one factor with a sorted row are sorted: #{products >= e} is a
cut found by binary search, for only the rows (i, o) whose largest product reaches e.
GradHist1d needs just those counts per edge; GradHist2d forms exactly the outer products (a
suffix of each sorted row) to bin them with their θ. The cost then grows with the rows and
outer elements, not with B·D. Where that would cost more (most values outer) these return
None and the part is materialised for the dense counter.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..rules.base import RankOne
from .bins import _OVER, _UNDER, EXTRAS, _Axis, _Queries

# rank-one parts are materialised when the per-edge searches (1-D) / the outer products
# (2-D) would be more than this fraction of the number of products
_CUT_WORK = 0.5
_SCREEN_WORK = 0.25


# A rounded product with |value| >= t has |exact product| >= t·(1 − 2⁻²³) (float32, and
# float64 a fortiori); screening with this much less keeps every such product, through the
# rounding of the screening products themselves and of the threshold to the data's dtype.
_SCREEN_SLACK = 1 - 2.0**-18
# the per-query work in NumPy on the CPU (a switch, so that tests run the torch path an
# accelerator takes)
_NUMPY_ON_CPU = True
_SAMPLES_TO_ESTIMATE = 32


@dataclass(frozen=True)
class _Arrays:
    """Where the per-query work runs: NumPy on the CPU (its ops on ~10⁴ values cost a half
    to a third of torch's there, per-call overhead included), else torch on the device. The
    code is written once over both (`xp`: the module)."""

    xp: Any
    device: torch.device

    @classmethod
    def of(cls, device: torch.device) -> _Arrays:
        return cls(np if _NUMPY_ON_CPU and device.type == "cpu" else torch, device)

    def host(self, t: Any) -> Any:
        """A tensor as an array of `xp` (a view)."""
        return t.detach().numpy() if self.xp is np and isinstance(t, Tensor) else t

    def arange(self, n: int) -> Any:
        return np.arange(n) if self.xp is np else torch.arange(n, device=self.device)

    def repeat(self, counts: Any) -> Any:
        """arange(len(counts)), entry k repeated counts[k] times."""
        if self.xp is np:
            return np.repeat(np.arange(len(counts)), counts)
        return torch.repeat_interleave(self.arange(len(counts)), counts)


def _usable_rows(left: Tensor, right: Tensor, with_order: bool) -> _SortedRows | None:
    """`right`'s rows sorted, if the counts of its products with `left` follow from the
    factors (see `_factors_usable`); None if not (a dtype NumPy cannot sort: not sorted)."""
    if left.dtype not in (torch.float32, torch.float64) or left.shape[0] > 2**24:
        return None
    rows = _SortedRows.build(right, with_order)
    return rows if _factors_usable(left, rows) else None


def _factors_usable(left: Tensor, rows: _SortedRows) -> bool:
    """Whether sign counts of the products of `left` (b, O) with the sorted `rows` (the
    other factor) follow from the factors' signs and every product is finite: float32 /
    float64 factors (half-precision products round in half), all finite, no nonzero product
    small enough to round to zero, none large enough to round to ±Inf. Also False for more
    than 2²⁴ samples (sign sums in float32)."""
    if left.dtype not in (torch.float32, torch.float64) or rows.samples > 2**24:
        return False
    if left.numel() == 0 or rows.width == 0:
        return True
    a_left = abs(_Arrays.of(left.device).host(left))
    # zeros read as 1 (no torch.where: several times slower on CPU): min(1, the smallest
    # nonzero) can only make the test stricter
    largest_l, largest_r, smallest_l, smallest_r = (float(v) for v in (
        a_left.max(), rows.largest.max(), (a_left + (a_left == 0)).min(), rows.smallest()))
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

    @functools.cached_property
    def _zeros(self) -> tuple[Tensor, Tensor]:
        """(#{r < 0}, #{r <= 0}) per sample (b,): where each row's zeros begin and end."""
        ascending = self.table.view(self.samples, -1)
        zero = ascending.new_zeros(self.samples, 1)
        return (torch.searchsorted(ascending, zero)[:, 0],
                torch.searchsorted(ascending, zero, right=True)[:, 0])

    def signs(self) -> tuple[Tensor, Tensor]:
        """(#negative, #positive) values per sample (b,), from the sorted rows."""
        negative, not_positive = self._zeros
        return negative, self.width - not_positive

    @functools.cached_property
    def largest(self) -> Tensor:
        """(b,) max |r| per sample, from the ends of each row (NaN, sorted last, if any)."""
        ascending = self.table.view(self.samples, -1)
        return torch.maximum(-ascending[:, 0], ascending[:, self.width - 1])

    def smallest(self) -> Tensor:
        """min |r| over the nonzero values (+Inf if none): the neighbours of the zeros."""
        negative, not_positive = self._zeros
        ascending = self.table.view(self.samples, -1)
        below = -ascending.gather(1, (negative - 1).clamp(min=0)[:, None])[:, 0]
        above = ascending.gather(1, not_positive[:, None])[:, 0]  # +Inf padding if none
        return torch.minimum(torch.where(negative > 0, below, math.inf), above).min()

    def count(self, sample: Any, factor: Any, threshold: Any, flip: Any) -> tuple[Any, Any]:
        """(#{r in row: fl(f'·r) >= threshold}, mirrored) per query, f' = −factor where
        `flip`, else factor (factor nonzero, threshold > 0). Mirrored (f' < 0): the count
        is a prefix of the ascending row, else a suffix. Arguments and results: tensors, or
        arrays of `_Arrays.of(device).xp`."""
        arrays = _Arrays.of(self.table.device)
        xp = arrays.xp
        table, sample, factor, threshold, flip = (
            arrays.host(t) for t in (self.table, sample, factor, threshold, flip))
        gather = table.take if xp is np else functools.partial(torch.index_select, table, 0)
        mirrored = (factor < 0) ^ flip
        # with a = |f'|: f' > 0 counts the rest of #{fl(a·r) < t}; f' < 0 (fl(f'·r) =
        # −fl(a·r)) counts #{fl(a·r) <= −t} = #{fl(a·r) < next float above −t}
        bound = xp.where(mirrored, xp.nextafter(-threshold, threshold + math.inf), threshold)
        a = abs(factor)
        # #{fl(a·r) < bound} by binary lifting over the padded rows: the cursor moves by 2ᵏ
        # wherever the product there is still below
        cursor = sample * (1 << self.span) - 1
        for step in (1 << k for k in range(self.span - 1, -1, -1)):
            cursor += (a * gather(cursor + step) < bound) * step
        below = cursor - (sample * (1 << self.span) - 1)
        return xp.where(mirrored, below, self.width - below), mirrored


def _search_work(left: Tensor, right: Tensor, first: float) -> int:
    """Binary-search steps of counting with `right`'s rows sorted, estimated on the first
    `_SAMPLES_TO_ESTIMATE` samples: the rows (i, o) whose products can reach the first
    threshold, times a search's depth (the products are the same either way; which side is
    sorted only decides the time)."""
    left, right = left[:_SAMPLES_TO_ESTIMATE], right[:_SAMPLES_TO_ESTIMATE]
    reach = left.abs() * right.abs().amax(1, keepdim=True) >= first
    return int(reach.sum()) * max(1, right.shape[1]).bit_length()


def _reached(left: Tensor, rows: _SortedRows, query: _Queries, most: float) -> Tensor | None:
    """#{products >= threshold} per query threshold (float64, on the device): the sum of
    `_SortedRows.count` over the (row (i, o), threshold) pairs the row can reach, sorted
    thresholds <= |left[i, o]|·max|row i| (with slack; most rows reach none). None when the
    searches would cost more than `most` products' classing."""
    arrays = _Arrays.of(left.device)
    xp = arrays.xp
    limits = arrays.host(query.threshold * _SCREEN_SLACK)
    reach = arrays.host((left.abs() * rows.largest[:, None]).reshape(-1))
    reaching = xp.where(reach >= limits[0])[0]
    per_row = xp.searchsorted(limits, reach[reaching], side="right")
    pairs = int(per_row.sum())
    if pairs * (rows.width.bit_length() + 4) > most:
        return None
    taken = arrays.repeat(per_row)
    entry = arrays.arange(pairs) - (per_row.cumsum(0) - per_row)[taken]  # k-th of its row
    row = reaching[taken]
    found, _ = rows.count(row // left.shape[1], arrays.host(left).reshape(-1)[row],
                          arrays.host(query.threshold)[entry], arrays.host(query.flip)[entry])
    reached = xp.bincount(entry, weights=xp.asarray(found, dtype=xp.float64),
                          minlength=len(limits))
    return torch.as_tensor(reached, dtype=torch.float64, device=left.device)  # (int if none)


def _rank_one_1d(part: RankOne, axis: _Axis) -> Tensor | None:
    """GradHist1d class counts (1, bins + 5) of a `RankOne` part's products, float64 on
    the device, from counts per edge instead of per product; None when not applicable
    (see `_factors_usable`) or when classing the products one by one is cheaper.

    For an edge e > 0, #{products >= e} is a sum over rows (i, o) of `_SortedRows.count`;
    only rows with |left[i, o]|·max|right[i]| >= e can reach e. For e < 0, #{products < e}
    = #{fl(−left·right) > |e|}; for e = 0 the sign counts. Bin k is then #{>= e_k} −
    #{>= e_k+1}.
    """
    query = axis.queries
    left, right = part.left, part.right
    if 2 * min(left.shape[1], right.shape[1]) > max(left.shape[1], right.shape[1]):
        first = float(query.threshold[0]) * _SCREEN_SLACK
        if _search_work(right, left, first) < _search_work(left, right, first):
            left, right = right, left
    elif left.shape[1] > right.shape[1]:  # search the longer side: far fewer rows
        left, right = right, left
    sorted_rows = _usable_rows(left, right, with_order=False)
    if sorted_rows is None:
        return None
    b, rows_per_sample = left.shape
    width = right.shape[1]
    device = left.device
    total = b * rows_per_sample * width
    n = axis.bins.count
    if total == 0:
        return torch.zeros(1, n + len(EXTRAS), dtype=torch.float64, device=device)
    reached = _reached(left, sorted_rows, query, total * _CUT_WORK)
    if reached is None:  # classing each product is cheaper
        return None
    # #{products >= e_k} for k = 0..n, then #{products > e_n}, from the reached counts
    nr, pr = sorted_rows.signs()
    arrays = _Arrays.of(device)
    host = arrays.host(left)
    pl, nl, nr, pr = (host > 0).sum(1), (host < 0).sum(1), arrays.host(nr), arrays.host(pr)
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
    left, right = part.left, part.right
    sorted_rows = _usable_rows(left, right, with_order=True)
    if sorted_rows is None:
        return None
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
    reach = (left.abs() * sorted_rows.largest[:, None]).reshape(-1)
    rows, flips, thresholds = [], [], []
    for bound, flipped in ((high, False), (-low, True)):
        if math.isfinite(bound):
            reaching = (reach >= bound * _SCREEN_SLACK).nonzero().squeeze(1)
            rows.append(reaching)
            flips.append(torch.full(reaching.shape, flipped, device=device))
            thresholds.append(left.new_full(reaching.shape, bound))
    row, flip, threshold = torch.cat(rows), torch.cat(flips), torch.cat(thresholds)
    order = sorted_rows.order
    assert order is not None  # asked for
    sample = row // width_o
    found, mirrored = (torch.as_tensor(t) for t in sorted_rows.count(
        sample, left.reshape(-1).index_select(0, row), threshold, flip))
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
