"""The rank-one counter (Linear layers): counts from the factors, never materialised,
equal numpy's on the materialised products; where they cannot, the fallback is exact."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepscope.instruments import histograms as H
from deepscope.instruments.histograms import (
    Bins,
    finite_abs_max,
    histogram_1d,
    histogram_2d,
)
from deepscope.instruments.histograms import bins as B
from deepscope.instruments.histograms import rank_one as RO

from . import reference as R
from .histogram_cases import (
    BIN_CASES,
    assert_matches_numpy,
    materialised,
    random_ranges,
    rank_one_tricky,
)


@pytest.mark.parametrize("numpy_on_cpu", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins", [*BIN_CASES, Bins(4, -0.5, 0.0), Bins(6, -3.0, -1.0)], ids=str)
def test_rank_one_1d_equals_numpy(monkeypatch, bins: Bins, dtype: torch.dtype,
                                  numpy_on_cpu: bool) -> None:
    monkeypatch.setattr(RO, "_CUT_WORK", math.inf)  # the searches even for dense data
    monkeypatch.setattr(RO, "_NUMPY_ON_CPU", numpy_on_cpu)  # False: an accelerator's path
    part = rank_one_tricky(dtype, bins)
    assert RO._rank_one_1d(part, B._axis(bins, dtype, torch.device("cpu"))) is not None
    assert_matches_numpy(histogram_1d(part, bins), materialised(part).numpy(), bins)


@pytest.mark.parametrize("sparse_side", ["left", "right"])
def test_rank_one_1d_sorts_the_side_with_fewer_searches(monkeypatch, sparse_side: str) -> None:
    """Factors of similar widths: the other side's rows are searched for the values of the
    side from which fewer products can reach the first edge (here the mostly-zero one, like
    a ReLU's output); the counts are the same either way."""
    bins = Bins(40, -1.0, 1.0)
    gen = torch.Generator().manual_seed(3)
    sparse = torch.zeros(5, 17)
    sparse[:, :2] = torch.randn(5, 2, generator=gen)
    dense = torch.randn(5, 13, generator=gen)
    part = H.RankOne(sparse, dense) if sparse_side == "left" else H.RankOne(dense, sparse)
    sorted_widths = []
    build = RO._SortedRows.build

    def spy(right: torch.Tensor, with_order: bool) -> RO._SortedRows:
        sorted_widths.append(right.shape[1])
        return build(right, with_order)

    monkeypatch.setattr(RO._SortedRows, "build", spy)
    monkeypatch.setattr(RO, "_CUT_WORK", math.inf)
    assert_matches_numpy(histogram_1d(part, bins), materialised(part).numpy(), bins)
    assert sorted_widths == [13]  # the dense factor's rows


@pytest.mark.parametrize("numpy_on_cpu", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_one_2d_equals_numpy(monkeypatch, dtype: torch.dtype, numpy_on_cpu: bool) -> None:
    monkeypatch.setattr(RO, "_SCREEN_WORK", math.inf)
    monkeypatch.setattr(RO, "_NUMPY_ON_CPU", numpy_on_cpu)  # False: an accelerator's path
    px, gy = Bins(40, -1.0, 1.0), Bins(50, -2.0, 2.0)
    part = rank_one_tricky(dtype, gy)
    theta = torch.rand(9, 23, generator=torch.Generator().manual_seed(2), dtype=dtype) * 2.6 - 1.3
    theta[0, :2] = torch.tensor([math.nan, 1.0])
    groups = B._axis(px, dtype, torch.device("cpu")).classify(theta.reshape(-1))
    axis = B._axis(gy, dtype, torch.device("cpu"))
    assert RO._rank_one_2d(part, axis, groups, px.count + 5) is not None
    got, want = histogram_2d(theta, part, px, gy), histogram_2d(theta, materialised(part), px, gy)
    np.testing.assert_array_equal(got.counts, want.counts)
    assert got.extras == want.extras
    if dtype == torch.float64:  # histogram2d's edges are float64 whatever the data
        G = materialised(part).reshape(6, -1).numpy()
        np.testing.assert_array_equal(got.counts, R.histogram_2d(theta.reshape(-1).numpy(), G,
                                                                 (40, 50), ((-1, 1), (-2, 2))))


@pytest.mark.parametrize("case", ["nan", "nan-sorted", "inf", "underflow", "underflow-negative",
                                  "overflow", "dense", "half", "bfloat16"])
def test_rank_one_fallbacks_stay_exact(case: str) -> None:
    """Where the factors do not determine the counts cheaply, the part is materialised."""
    bins = Bins(20, -1.0, 1.0)
    part = rank_one_tricky(torch.float32, bins)
    left, right = part.left.clone(), part.right.clone()
    if case == "nan":
        left[1, 2] = math.nan
    elif case == "nan-sorted":  # in the longer factor, whose rows are sorted
        right[1, 2] = math.nan
    elif case == "inf":
        right[3, 5] = -math.inf
    elif case == "underflow":  # 1e-30 · 1e-20 rounds to 0 in float32: sign counts would lie
        left[0, 0], right[0, 1] = -1e-30, 1e-20
    elif case == "underflow-negative":  # the same, the smallest |r| a negative r, in a row
        left[0, 0], right[2, 1] = 1e-30, -1e-20  # other than the smallest |left|'s
    elif case == "overflow":  # a product of finite factors that rounds to +Inf
        left[0, 0], right[0, 1] = 1e30, 1e20
    elif case == "dense":  # most products outside the sign zone
        right = right * 1e3
    elif case == "half":
        left, right = left.half(), right.half()
    else:  # a dtype NumPy has not: never sorted there
        left, right = left.bfloat16(), right.bfloat16()
    part = H.RankOne(left, right)
    axis = B._axis(bins, torch.float32, torch.device("cpu"))
    if case not in ("dense", "half", "bfloat16"):
        assert not RO._factors_usable(part.left, RO._SortedRows.build(part.right, False))
    assert RO._rank_one_1d(part, axis) is None
    values = materialised(part)
    assert_matches_numpy(histogram_1d(part, bins), values.float().numpy(), bins)
    want = histogram_2d(torch.zeros(9, 23), values, Bins(4, -1.0, 1.0), bins)
    got = histogram_2d(torch.zeros(9, 23), part, Bins(4, -1.0, 1.0), bins)
    np.testing.assert_array_equal(got.counts, want.counts)
    assert got.extras == want.extras
    assert finite_abs_max(part) == finite_abs_max(values)


@random_ranges([1e-3, 1e-1, 1.0, 10.0])
def test_rank_one_random_data_and_ranges(seed, bins, lo, width, scale) -> None:
    spec = Bins(bins, lo, lo + width)
    gen = torch.Generator().manual_seed(seed)
    part = H.RankOne(torch.randn(4, 7, generator=gen) * scale, torch.randn(4, 31, generator=gen))
    with pytest.MonkeyPatch.context() as patch:  # the searches, whatever the density
        patch.setattr(RO, "_CUT_WORK", math.inf)
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
