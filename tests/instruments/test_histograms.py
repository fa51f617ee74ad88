"""Exact GradHist1d / GradHist2d counts against numpy.histogram / histogram2d."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepscope.instruments import histograms as H
from deepscope.instruments.histograms import (
    Bins,
    Histogram,
    finite_abs_max,
    histogram_1d,
    histogram_2d,
    symmetric_bins,
)

from . import reference as R

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EXTRA_KEYS = ("underflow", "overflow", "nan", "posinf", "neginf")


def tricky(dtype: torch.dtype, bins: Bins, nonfinite: bool = True) -> torch.Tensor:
    """(B, 40, 30) gradients: mostly small, some outliers, every edge and its neighbours,
    ±0, out-of-range values, and (if `nonfinite`) NaN and ±Inf."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(12, 40, 30, generator=gen, dtype=torch.float64) * 0.01
    g[0, 0, :5] = torch.randn(5, generator=gen, dtype=torch.float64) * 3
    edges = torch.from_numpy(np.linspace(bins.lo, bins.hi, bins.count + 1)).to(dtype)
    near = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)])
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
    monkeypatch.setattr(H, "_BLOCK", 16)
    for chunk in (1, 1000, 3000, 1 << 20):
        monkeypatch.setitem(H._CHUNK_ELEMENTS, "cpu", chunk)
        assert_matches_numpy(histogram_1d(g, bins), g.numpy(), bins)


@given(
    seed=st.integers(0, 2**16),
    bins=st.integers(1, 60),
    lo=st.floats(-3, 0.5),
    width=st.floats(1e-3, 5),
    scale=st.sampled_from([1e-4, 1e-2, 1.0, 10.0]),
)
@settings(max_examples=40, deadline=None)
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


# -- rank-one parts (Linear layers): counted from the factors, never materialised ----------
def rank_one_tricky(dtype: torch.dtype, bins: Bins, b: int = 6, o: int = 9, i: int = 23):
    """Factors whose products hit every edge exactly and its float neighbours (power-of-two
    left factors times edge values), with ±0, both signs and repeated values. (The
    neighbours of an edge at 0 are left out: their products could round to 0.)"""
    gen = torch.Generator().manual_seed(7)
    edges = torch.from_numpy(np.linspace(bins.lo, bins.hi, bins.count + 1)).to(dtype)
    near = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)])
    near = near[(near == 0) | (near.abs() > 1e-30)]
    left = (torch.randn(b, o, generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    left[:, :4] = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=dtype)
    left[0, 4], left[1, 4] = 0.0, -0.0
    right = (torch.randn(b, i, generator=gen, dtype=torch.float64) * 0.05).to(dtype)
    picks = near[torch.randint(0, near.numel(), (b, i // 2), generator=gen)]
    right[:, : i // 2] = picks
    right[:, -3:] = right[:, :3]  # repeats
    right[2, -1] = 0.0
    return H.RankOne(left, right)


def materialised(part: H.RankOne) -> torch.Tensor:
    return part.left[:, :, None] * part.right[:, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins", [*BIN_CASES, Bins(4, -0.5, 0.0), Bins(6, -3.0, -1.0)], ids=str)
def test_rank_one_1d_equals_numpy(monkeypatch, bins: Bins, dtype: torch.dtype) -> None:
    monkeypatch.setattr(H, "_CUT_WORK", math.inf)  # the searches even for dense data
    part = rank_one_tricky(dtype, bins)
    assert H._rank_one_1d(part, H._axis(bins, dtype, torch.device("cpu"))) is not None
    assert_matches_numpy(histogram_1d(part, bins), materialised(part).numpy(), bins)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_one_2d_equals_numpy(monkeypatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(H, "_SCREEN_WORK", math.inf)
    px, gy = Bins(40, -1.0, 1.0), Bins(50, -2.0, 2.0)
    part = rank_one_tricky(dtype, gy)
    theta = torch.rand(9, 23, generator=torch.Generator().manual_seed(2), dtype=dtype) * 2.6 - 1.3
    theta[0, :2] = torch.tensor([math.nan, 1.0])
    groups = H._axis(px, dtype, torch.device("cpu")).classify(theta.reshape(-1))
    axis = H._axis(gy, dtype, torch.device("cpu"))
    assert H._rank_one_2d(part, axis, groups, px.count + 5) is not None
    got, want = histogram_2d(theta, part, px, gy), histogram_2d(theta, materialised(part), px, gy)
    np.testing.assert_array_equal(got.counts, want.counts)
    assert got.extras == want.extras
    if dtype == torch.float64:  # histogram2d's edges are float64 whatever the data
        G = materialised(part).reshape(6, -1).numpy()
        np.testing.assert_array_equal(got.counts, R.histogram_2d(theta.reshape(-1).numpy(), G,
                                                                 (40, 50), ((-1, 1), (-2, 2))))


@pytest.mark.parametrize("case", ["nan", "inf", "underflow", "overflow", "dense", "half"])
def test_rank_one_fallbacks_stay_exact(case: str) -> None:
    """Where the factors do not determine the counts cheaply, the part is materialised."""
    bins = Bins(20, -1.0, 1.0)
    part = rank_one_tricky(torch.float32, bins)
    left, right = part.left.clone(), part.right.clone()
    if case == "nan":
        left[1, 2] = math.nan
    elif case == "inf":
        right[3, 5] = -math.inf
    elif case == "underflow":  # 1e-30 · 1e-20 rounds to 0 in float32: sign counts would lie
        left[0, 0], right[0, 1] = -1e-30, 1e-20
    elif case == "overflow":  # a product of finite factors that rounds to +Inf
        left[0, 0], right[0, 1] = 1e30, 1e20
    elif case == "dense":  # most products outside the sign zone
        right = right * 1e3
    else:
        left, right = left.half(), right.half()
    part = H.RankOne(left, right)
    axis = H._axis(bins, torch.float32, torch.device("cpu"))
    if case != "dense":
        assert not H._factors_usable(part)
    else:
        assert H._rank_one_1d(part, axis) is None
    values = materialised(part)
    assert_matches_numpy(histogram_1d(part, bins), values.float().numpy(), bins)
    want = histogram_2d(torch.zeros(9, 23), values, Bins(4, -1.0, 1.0), bins)
    got = histogram_2d(torch.zeros(9, 23), part, Bins(4, -1.0, 1.0), bins)
    np.testing.assert_array_equal(got.counts, want.counts)
    assert got.extras == want.extras
    assert finite_abs_max(part) == finite_abs_max(values)


@given(
    seed=st.integers(0, 2**16),
    bins=st.integers(1, 60),
    lo=st.floats(-3, 0.5),
    width=st.floats(1e-3, 5),
    scale=st.sampled_from([1e-3, 1e-1, 1.0, 10.0]),
)
@settings(max_examples=40, deadline=None)
def test_rank_one_random_data_and_ranges(seed, bins, lo, width, scale) -> None:
    spec = Bins(bins, lo, lo + width)
    gen = torch.Generator().manual_seed(seed)
    part = H.RankOne(torch.randn(4, 7, generator=gen) * scale, torch.randn(4, 31, generator=gen))
    with pytest.MonkeyPatch.context() as patch:  # the searches, whatever the density
        patch.setattr(H, "_CUT_WORK", math.inf)
        assert_matches_numpy(histogram_1d(part, spec), materialised(part).numpy(), spec)


def test_parts_add_up_like_the_whole() -> None:
    bins = Bins(30, -0.2, 0.2)
    part = rank_one_tricky(torch.float32, bins, b=10)
    whole = materialised(part)
    pieces = [H.RankOne(part.left[:3], part.right[:3]), whole[3:7],
              H.RankOne(part.left[7:], part.right[7:])]
    assert_matches_numpy(histogram_1d(pieces, bins), whole.numpy(), bins)
    assert finite_abs_max(pieces) == finite_abs_max(whole)
    with pytest.raises(ValueError, match="no per-sample gradients"):
        histogram_1d([], bins)


def test_classify_near_edges_matches_bucketize() -> None:
    """The arithmetic first guess is only trusted away from edges: every edge, its float
    neighbours and far-away values class exactly as a search over the edges would."""
    for bins in [*BIN_CASES, Bins(7, 1e4, 1e4 + 0.5), Bins(3, -1e-30, 1e-30)]:
        for dtype in (torch.float32, torch.float64):
            axis = H._axis(bins, dtype, torch.device("cpu"))
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
            axis = H._axis(bins, dtype, torch.device("cpu"))
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
