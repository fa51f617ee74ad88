"""The dense counter: exact GradHist1d / GradHist2d counts of materialised gradients
against numpy.histogram / histogram2d."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepscope.instruments.histograms import (
    Bins,
    histogram_1d,
    histogram_2d,
)
from deepscope.instruments.histograms import dense as D

from . import reference as R
from .histogram_cases import (
    BIN_CASES,
    DEVICES,
    EXTRA_KEYS,
    assert_matches_numpy,
    random_ranges,
    tricky,
)


@pytest.fixture(autouse=True, params=["torch", "numpy"])
def counter(request, monkeypatch) -> str:
    """Every test on both CPU paths: torch's sign counting (what an accelerator and big
    tensors take) and NumPy's small-tensor path (`_small_counts`, e.g. a Linear bias)."""
    if request.param == "torch":
        monkeypatch.setattr(D, "_SMALL_ELEMENTS", 0)
    else:
        monkeypatch.setattr(D, "_SMALL_ELEMENTS", 1 << 30)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nonfinite", [True, False])  # NaN takes another code path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins", BIN_CASES, ids=str)
def test_1d_counts_equal_numpy(bins: Bins, dtype: torch.dtype, nonfinite: bool, device: str):
    g = tricky(dtype, bins, nonfinite).to(device)
    assert_matches_numpy(histogram_1d(g, bins), g.cpu().numpy(), bins)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_binned_as_float32(dtype: torch.dtype) -> None:
    bins = Bins(20, -0.05, 0.05)
    g = tricky(dtype, bins)
    assert_matches_numpy(histogram_1d(g, bins), g.float().numpy(), bins)


@pytest.mark.parametrize("outliers", [0.0, 1e-4, 0.02, 0.5])
def test_chunking_and_block_screening_do_not_change_counts(monkeypatch, outliers) -> None:
    """Small chunks and blocks exercise every path: no outer values, sparse outer values
    found block by block, dense ones found by one scan, and a ragged tail."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(9, 1001, generator=gen) * 0.005
    mask = torch.rand(g.shape, generator=gen) < outliers
    g[mask] = torch.randn(int(mask.sum()), generator=gen)
    bins = Bins(50, -1.0, 1.0)
    edges = np.linspace(-1.0, 1.0, 51, dtype=np.float32)
    g[2, 500], g[5, 17], g[8, 1000] = float(edges[24]), float(edges[26]), float(edges[25])
    monkeypatch.setattr(D, "_BLOCK", 16)
    for chunk in (1, 1000, 3000, 1 << 20):
        monkeypatch.setitem(D._CHUNK_ELEMENTS, "cpu", chunk)
        assert_matches_numpy(histogram_1d(g, bins), g.numpy(), bins)


@random_ranges([1e-4, 1e-2, 1.0, 10.0])
def test_1d_random_data_and_ranges(seed, bins, lo, width, scale) -> None:
    spec = Bins(bins, lo, lo + width)
    g = torch.randn(5, 37, generator=torch.Generator().manual_seed(seed)) * scale
    assert_matches_numpy(histogram_1d(g, spec), g.numpy(), spec)


def test_2d_counts_equal_numpy_and_every_pair_is_counted_once() -> None:
    gen = torch.Generator().manual_seed(5)
    theta = torch.rand(40, 30, generator=gen, dtype=torch.float64) * 2.6 - 1.3
    theta[0, :3] = torch.tensor([math.nan, math.inf, -1.0])
    px, gy = Bins(40, -1.0, 1.0), Bins(50, -2.0, 2.0)
    g = tricky(torch.float64, gy)
    hist = histogram_2d(theta, g, px, gy)
    G, T = g.reshape(12, -1).numpy(), theta.reshape(-1).numpy()
    np.testing.assert_array_equal(hist.counts, R.histogram_2d(T, G, (40, 50), ((-1, 1), (-2, 2))))
    assert hist.counts.shape == (40, 50) and hist.counts.dtype == np.int64
    pairs_theta = np.broadcast_to(T, G.shape)
    in_range = np.isfinite(pairs_theta) & (pairs_theta >= -1) & (pairs_theta <= 1)
    assert hist.extras["param_nonfinite"] == int((~np.isfinite(pairs_theta)).sum()) == 24
    finite = np.isfinite(pairs_theta)
    assert hist.extras["param_underflow"] == int((finite & (pairs_theta < -1)).sum())
    assert hist.extras["param_overflow"] == int((finite & (pairs_theta > 1)).sum())
    _, extras = R.histogram_1d(G[in_range], 50, -2.0, 2.0)
    assert {k: hist.extras[k] for k in EXTRA_KEYS} == extras
    assert hist.counts.sum() + sum(hist.extras.values()) == G.size
    assert hist.meta()["edges"] == [[-1.0, 1.0, 40], [-2.0, 2.0, 50]]


def test_2d_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"grads must have shape \(B, \*\(3,\)\)"):
        histogram_2d(torch.zeros(3), torch.zeros(2, 4), Bins(4, -1, 1), Bins(4, -1, 1))


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_2d_counts_added_sample_by_sample_equal_numpy(monkeypatch, chunk: int) -> None:
    """GradHist2d fed one sample per part (a big layer's per-sample gradients), with parts
    of another dtype in between (another axis) and outer values in some rows only: the
    sign counts tallied per column over the parts and folded once equal numpy's."""
    from deepscope.instruments.histograms import GradHistogram

    monkeypatch.setitem(D._CHUNK_ELEMENTS, "cpu", chunk)
    gen = torch.Generator().manual_seed(8)
    theta = torch.rand(6, 9, generator=gen, dtype=torch.float64) * 2.4 - 1.2
    px, gy = Bins(40, -1.0, 1.0), Bins(50, -2.0, 2.0)
    g = torch.randn(11, 6, 9, generator=gen, dtype=torch.float64) * 0.01
    g[3, 0, :4] = torch.tensor([3.0, -0.5, 0.0, math.nan])
    g[7] = torch.randn(6, 9, generator=gen, dtype=torch.float64)  # a row of outer values
    hist = GradHistogram(gy, theta, px)
    for i in range(g.shape[0]):
        hist.add(g[i:i + 1].float() if i in (5, 6) else g[i:i + 1])
    counted = g.clone()
    counted[5:7] = g[5:7].float().double()
    G, T = counted.reshape(11, -1).numpy(), theta.reshape(-1).numpy()
    result = hist.result()
    np.testing.assert_array_equal(result.counts,
                                  R.histogram_2d(T, G, (40, 50), ((-1, 1), (-2, 2))))
    assert result.counts.sum() + sum(result.extras.values()) == G.size
    assert hist.table() is hist.table()  # folded once: a second table adds nothing


def test_small_and_large_parts_of_one_2d_histogram_add_up(monkeypatch) -> None:
    """GradHist2d fed parts of which some take the NumPy small-tensor path and others the
    torch path (their sign counts tallied per column and folded at the end), in any
    order: the counts equal numpy's for all the samples."""
    from deepscope.instruments.histograms import GradHistogram

    monkeypatch.setattr(D, "_SMALL_ELEMENTS", 100)  # a 1-sample part (54) is small, 5 not
    gen = torch.Generator().manual_seed(9)
    theta = torch.rand(6, 9, generator=gen, dtype=torch.float64) * 2.4 - 1.2
    px, gy = Bins(40, -1.0, 1.0), Bins(50, -2.0, 2.0)
    g = torch.randn(13, 6, 9, generator=gen, dtype=torch.float64) * 0.02
    g[0, 0, :3] = torch.tensor([3.0, -0.0, math.nan])
    g[6, 2, :3] = torch.tensor([-math.inf, 0.08, -0.08])
    hist = GradHistogram(gy, theta, px)
    for lo, hi in ((0, 1), (1, 6), (6, 7), (7, 12), (12, 13)):
        hist.add(g[lo:hi])
    G, T = g.reshape(13, -1).numpy(), theta.reshape(-1).numpy()
    result = hist.result()
    np.testing.assert_array_equal(result.counts,
                                  R.histogram_2d(T, G, (40, 50), ((-1, 1), (-2, 2))))
    assert result.counts.sum() + sum(result.extras.values()) == G.size
