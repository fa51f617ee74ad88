"""Shared data for the histogram tests: gradients and factors that hit every edge, its float
neighbours, ±0, out-of-range and non-finite values; the numpy comparison."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepscope.instruments.histograms import Bins, Histogram, RankOne

from . import reference as R

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EXTRA_KEYS = ("underflow", "overflow", "nan", "posinf", "neginf")


def edges_and_neighbours(bins: Bins, dtype: torch.dtype) -> torch.Tensor:
    """Every edge of `bins` in `dtype`, then the next float above and below each."""
    edges = torch.from_numpy(np.linspace(bins.lo, bins.hi, bins.count + 1)).to(dtype)
    return torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)])


def random_ranges(scales: list[float]) -> Callable[[Callable], Callable]:
    """Hypothesis: a test of (seed, bins, lo, width, scale) over random axes and data scales."""
    return lambda test: settings(max_examples=40, deadline=None)(given(
        seed=st.integers(0, 2**16),
        bins=st.integers(1, 60),
        lo=st.floats(-3, 0.5),
        width=st.floats(1e-3, 5),
        scale=st.sampled_from(scales),
    )(test))


def tricky(dtype: torch.dtype, bins: Bins, nonfinite: bool = True) -> torch.Tensor:
    """(B, 40, 30) gradients: mostly small, some outliers, every edge and its neighbours,
    ±0, out-of-range values, and (if `nonfinite`) NaN and ±Inf."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(12, 40, 30, generator=gen, dtype=torch.float64) * 0.01
    g[0, 0, :5] = torch.randn(5, generator=gen, dtype=torch.float64) * 3
    near = edges_and_neighbours(bins, dtype)
    flat = g.to(dtype).reshape(-1)
    flat[100 : 100 + near.numel()] = near
    flat[300:306] = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, bins.hi * 10 + 1])
    if not nonfinite:
        flat[302:305] = 0.5 * (bins.lo + bins.hi)
    flat[306] = bins.lo - abs(bins.lo) - 1
    return flat.reshape(g.shape)


def assert_matches_numpy(hist: Histogram, values: np.ndarray, bins: Bins) -> None:
    counts, extras = R.histogram_1d(values, bins.count, bins.lo, bins.hi)
    np.testing.assert_array_equal(hist.counts, counts)
    assert hist.extras == extras
    assert hist.counts.sum() + sum(hist.extras.values()) == values.size


BIN_CASES = [
    Bins(100, -2.0, 2.0),
    Bins(7, -0.3, 0.1),  # zero inside a bin, not on an edge
    Bins(5, 0.1, 0.5),  # range above zero: small values are underflow
    Bins(3, -1.0, 0.0),  # zero is the closed right edge
    Bins(1, -1e-3, 1e-3),
]


def rank_one_tricky(dtype: torch.dtype, bins: Bins, b: int = 6, o: int = 9, i: int = 23):
    """Factors whose products hit every edge exactly and its float neighbours (power-of-two
    left factors times edge values), with ±0, both signs and repeated values. (The
    neighbours of an edge at 0 are left out: their products could round to 0.)"""
    gen = torch.Generator().manual_seed(7)
    near = edges_and_neighbours(bins, dtype)
    near = near[(near == 0) | (near.abs() > 1e-30)]
    left = (torch.randn(b, o, generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    left[:, :4] = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=dtype)
    left[0, 4], left[1, 4] = 0.0, -0.0
    right = (torch.randn(b, i, generator=gen, dtype=torch.float64) * 0.05).to(dtype)
    picks = near[torch.randint(0, near.numel(), (b, i // 2), generator=gen)]
    right[:, : i // 2] = picks
    right[:, -3:] = right[:, :3]  # repeats
    right[2, -1] = 0.0
    return RankOne(left, right)


def materialised(part: RankOne) -> torch.Tensor:
    return part.left[:, :, None] * part.right[:, None, :]
