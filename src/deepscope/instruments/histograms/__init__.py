"""Exact histograms of per-sample gradient elements (GradHist1d) and of (θₐ, gᵢ,ₐ) pairs
(GradHist2d), computed on the tensors' device part by part (consecutive samples) and sent
to the host once, at the end.

Binning is numpy.histogram's (see `bins`), exact, with out-of-range and non-finite
values counted apart. Why it is fast: most elements are counted by their sign alone (see
`dense`), and outer-product parts of Linear layers are counted from their factors without
being materialised (see `rank_one`).

The package: `bins` (axes and the stored format), `dense` (the dense counter) and
`rank_one` (the rank-one counter); `GradHistogram` here drives them part by part.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from ..rules.base import Part, RankOne
from .bins import (
    _NAN,
    _OVER,
    _UNDER,
    EXTRAS,
    Bins,
    Histogram,
    _axis,
    _clamped,
    _split_extras,
    _work_dtype,
    symmetric_bins,
)
from .dense import (
    ColumnSigns,
    _flat_rows,
    _grouped_counts,
    _is_small,
    _materialised,
    _small_counts,
)
from .rank_one import _rank_one_1d, _rank_one_2d

__all__ = ["EXTRAS", "Bins", "GradHistogram", "Histogram", "RankOne", "finite_abs_max",
           "histogram_1d", "histogram_2d", "histogram_of_table", "symmetric_bins"]


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
        # GradHist2d: the values counted by sign, per column, until `table` folds them
        self._tally: ColumnSigns | None = None

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
                rows = _flat_rows(chunk)
                if _is_small(rows):
                    more = _small_counts(rows, axis, groups, n_groups)
                else:
                    if groups is not None and (self._tally is None
                                               or self._tally.axis is not axis):
                        self._fold()  # (a part of another dtype: another axis)
                        self._tally = ColumnSigns(axis, groups, n_groups)
                    more = _grouped_counts(rows, axis, groups, n_groups, self._tally)
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

    def table(self) -> Tensor:
        """The raw class counts so far: float64 (1, bins + 5) for GradHist1d, (param bins +
        5, bins + 5) for GradHist2d, on the device (exact integers; additive, so tables of
        disjoint samples sum to the table of their union).

        Raises:
            ValueError: if nothing was added.
        """
        if self._counts is None:
            raise ValueError("no per-sample gradients were added to the histogram")
        self._fold()
        return self._counts

    def _fold(self) -> None:
        """Fold the tallied sign counts (GradHist2d) into the counts."""
        if self._tally is not None:
            assert self._counts is not None  # the tally's part was counted into it
            self._counts = self._counts + self._tally.fold()
            self._tally = None

    def result(self) -> Histogram:
        """The counts so far (one transfer to the host).

        Raises:
            ValueError: if nothing was added.
        """
        return histogram_of_table(self.table(), self.bins, self.param_bins)


def histogram_of_table(table: Tensor, bins: Bins, param_bins: Bins | None = None) -> Histogram:
    """The Histogram of a raw class-count table (`GradHistogram.table`, possibly summed
    over the ranks of a distributed run) on the gradient axis `bins` (and the θ axis
    `param_bins` for GradHist2d)."""
    table = table.cpu()
    gy = bins.count
    if param_bins is None:
        row = table[0]
        counts = row[:gy].numpy().astype(np.int64)
        return Histogram(counts, _split_extras(row, gy), bins.spec())
    px = param_bins.count
    inside = table[:px]
    extras = _split_extras(inside.sum(0), gy)
    outside = table[px:].sum(1).tolist()  # pairs by θ's class
    extras["param_underflow"] = int(outside[_UNDER])
    extras["param_overflow"] = int(outside[_OVER])
    extras["param_nonfinite"] = int(sum(outside[_NAN:]))
    counts = inside[:, :gy].numpy().astype(np.int64)
    return Histogram(counts, extras, [param_bins.spec(), bins.spec()],
                     _clamped(table.numpy(), px, gy))


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
