"""Histogram axes and the stored format: bins validation, classes of values near edges,
adding histograms and their meta."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepscope.instruments.histograms import (
    Bins,
    finite_abs_max,
    histogram_1d,
    symmetric_bins,
)
from deepscope.instruments.histograms import bins as B

from .histogram_cases import (
    BIN_CASES,
)


def test_histograms_add_and_meta() -> None:
    bins = Bins(4, -1.0, 1.0)
    a = histogram_1d(torch.tensor([[0.1, 5.0]]), bins)
    b = histogram_1d(torch.tensor([[-0.9, math.nan]]), bins)
    total = a + b
    np.testing.assert_array_equal(total.counts, [1, 0, 1, 0])
    assert total.meta() == {"edges": [-1.0, 1.0, 4], "underflow": 0, "overflow": 1, "nan": 1,
                            "posinf": 0, "neginf": 0}
    with pytest.raises(ValueError, match="cannot add histograms"):
        a + histogram_1d(torch.zeros(1, 1), Bins(5, -1.0, 1.0))


def test_bins_validation() -> None:
    with pytest.raises(ValueError, match="bins must be >= 1"):
        Bins(0, -1.0, 1.0)
    with pytest.raises(TypeError, match="bins must be an int"):
        Bins(2.5, -1.0, 1.0)
    with pytest.raises(ValueError, match="lo < hi"):
        Bins(3, 1.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        Bins(3, -math.inf, 1.0)
    with pytest.raises(TypeError, match="floating-point"):
        histogram_1d(torch.zeros(2, 2, dtype=torch.long), Bins(3, -1.0, 1.0))


def test_adaptive_range_helpers() -> None:
    assert finite_abs_max(torch.tensor([[-3.0, 2.0, math.inf, math.nan]])) == 3.0
    assert finite_abs_max(torch.tensor([[math.nan, -math.inf]])) == 0.0
    assert finite_abs_max(torch.tensor([[0.5, -0.25]])) == 0.5
    assert symmetric_bins(10, 0.0) == Bins(10, -0.5, 0.5)
    assert symmetric_bins(10, 2.5) == Bins(10, -2.5, 2.5)


def test_classify_near_edges_matches_bucketize() -> None:
    """The arithmetic first guess is only trusted away from edges: every edge, its float
    neighbours and far-away values class exactly as a search over the edges would."""
    for bins in [*BIN_CASES, Bins(7, 1e4, 1e4 + 0.5), Bins(3, -1e-30, 1e-30)]:
        for dtype in (torch.float32, torch.float64):
            axis = B._axis(bins, dtype, torch.device("cpu"))
            e = axis.edges
            x = torch.cat([e, torch.nextafter(e, e + 1), torch.nextafter(e, e - 1),
                           torch.randn(500, dtype=dtype) * (bins.hi - bins.lo) + bins.lo,
                           torch.tensor([0.0, -0.0, 1e30, -1e30, math.nan, math.inf,
                                         -math.inf], dtype=dtype)])
            assert torch.equal(axis.classify(x), axis._classify_exactly(x)), bins
            want = torch.bucketize(x, e, right=True) - 1
            want = torch.where(x == e[-1], bins.count - 1, want)
            finite = x.isfinite()
            inside = finite & (want >= 0) & (want < bins.count)
            assert torch.equal(axis.classify(x)[inside], want[inside]), bins


def test_numpy_and_torch_guesses_agree() -> None:
    """The CPU classes values with NumPy, other devices with torch: the same first guess and
    the same unsure values, so the torch path (untested here without a GPU) stays exact."""
    for bins in [*BIN_CASES, Bins(40, -1.0, 1.0), Bins(3, -1e-30, 1e-30)]:
        for dtype in (torch.float32, torch.float64):
            axis = B._axis(bins, dtype, torch.device("cpu"))
            e = axis.edges
            x = torch.cat([e, torch.nextafter(e, e + 1), torch.nextafter(e, e - 1),
                           torch.randn(2000, dtype=dtype) * (bins.hi - bins.lo) + bins.lo,
                           torch.tensor([0.0, -0.0, 1e30, -1e30, 3e38, math.nan, math.inf,
                                         -math.inf], dtype=dtype)])
            index_np, unsure_np = axis._guess_numpy(x)
            index_t, unsure_t = axis._guess_torch(x)
            assert torch.equal(unsure_np, unsure_t), bins
            assert bool(unsure_np[-3:].all())  # NaN, ±Inf: always classed exactly
            assert torch.equal(index_np[~unsure_np], index_t[~unsure_t]), bins
