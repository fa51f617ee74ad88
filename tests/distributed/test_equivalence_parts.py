"""The pieces the global batch is built from, in one process: merged moments, the gradient
tests from sums, the check of the speculative ḡ, histograms from summed class tables."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from deepscope.instruments.global_batch import _merged, _moments, common_factor
from deepscope.instruments.histograms import GradHistogram, histogram_of_table
from deepscope.instruments.histograms.bins import Bins
from deepscope.instruments.quantities import (
    inner_test,
    inner_test_of_sums,
    ortho_test,
    ortho_test_of_sums,
)


def test_moments_merged_over_ranks_equal_those_of_the_concatenation():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=gen, dtype=torch.float64) * 0.1 + 5 for n in (7, 0, 9)]
    block = torch.stack([torch.cat([torch.tensor([float(len(p))]),
                                    _moments(p) if len(p) else torch.zeros(2)])
                         for p in parts])
    mean, m2 = _merged(block, 1).tolist()
    var, want = torch.var_mean(torch.cat(parts), correction=0)
    assert math.isclose(mean, float(want), rel_tol=1e-15)
    assert math.isclose(m2 / 16, float(var), rel_tol=1e-12)


def test_gradient_tests_from_sums_equal_those_from_per_sample_products():
    gen = torch.Generator().manual_seed(1)
    Q = torch.randn(3, 16, generator=gen, dtype=torch.float64) + 0.5
    S = Q.square().sum(1) * 3  # any S >= Σ Q²/N
    N = torch.tensor([0.7, 1.1, 0.4], dtype=torch.float64)
    assert torch.allclose(inner_test_of_sums(Q.sum(1), Q.square().sum(1), N, 16),
                          inner_test(Q, N, 16), rtol=1e-12, atol=0)
    assert torch.allclose(ortho_test_of_sums(S, Q.square().sum(1), N, 16),
                          ortho_test(S, Q, N, 16), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_speculative_mean_gradient_is_kept_only_up_to_one_common_factor(dtype):
    gen = torch.Generator().manual_seed(2)
    exact = [torch.randn(4, 3, generator=gen, dtype=torch.float64),
             torch.randn(3, generator=gen, dtype=torch.float64)]
    scaled = [(0.25 * e).to(dtype) for e in exact]  # e.g. clipping, rounded to dtype
    assert math.isclose(common_factor(scaled, exact), 0.25, rel_tol=1e-6)
    # one tensor scaled apart: not one common factor
    assert common_factor([scaled[0], 2 * scaled[1]], exact) is None
    # the mean of two ranks' means with unequal batches (7 + 9) is not ḡ
    assert common_factor([(e + 1e-3 * torch.ones_like(e)).to(dtype) for e in exact],
                         exact) is None
    assert common_factor(scaled, [torch.zeros_like(e) for e in exact]) is None


def test_histograms_from_summed_class_tables_equal_the_histogram_of_all_samples():
    gen = torch.Generator().manual_seed(3)
    grads = torch.randn(16, 5, 4, generator=gen, dtype=torch.float64) * 2
    params = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    for make, axes in ((lambda: GradHistogram(Bins(10, -2, 2)), (Bins(10, -2, 2), None)),
                       (lambda: GradHistogram(Bins(6, -2, 2), params, Bins(4, -1, 1)),
                        (Bins(6, -2, 2), Bins(4, -1, 1)))):
        whole, first, second = make(), make(), make()
        whole.add(grads)
        first.add(grads[:7])
        second.add(grads[7:])
        got = histogram_of_table(first.table() + second.table(), *axes)
        want = whole.result()
        assert (got.counts == want.counts).all() and got.meta() == want.meta()


def test_a_reducer_must_be_a_reducer():
    from deepscope.instruments.suite import Instruments

    with pytest.raises(TypeError, match="reducer must be a deepscope.distributed.Reducer"):
        Instruments(nn.Linear(2, 1), "economy", reducer="auto")
