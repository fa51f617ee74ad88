"""The fast summary paths against the general one (`tensor_stats` + `array_views`), which
test_stats.py checks against NumPy in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepscope.recorder.fast import fast_batched, fast_parameters
from deepscope.recorder.stats import array_views, small_summaries, tensor_stats
from deepscope.recorder.summary import Capture, summarise_captures
from deepscope.store import arrays
from deepscope.store.schema import STAT_COLUMNS

CASES = [  # (shape, batch_dim, scale, offset)
    ((16, 40), 0, 1.0, 0.0),
    ((6, 5, 7), 1, 3.0, 1.0),
    ((9, 3, 4, 5), 0, 0.1, -2.0),
    ((30, 20), None, 1.0, 0.5),
    ((8, 3, 3, 3), None, 2.0, 0.0),
    ((12,), 0, 1.0, 0.0),
]


def general(x: torch.Tensor, batch_dim: int | None, **kw) -> tuple[torch.Tensor, dict]:
    return tensor_stats(x), array_views(x, batch_dim, **kw)


def assert_same(got: tuple, want: tuple, view_rtol: float = 1e-5) -> None:
    row, views = got
    want_row, want_views = want
    # Float32 sums are exact to ~1e-7 of the tensor's scale, not of a mean near zero.
    scale = want_row[STAT_COLUMNS.index("abs_mean")].item()
    for k, a, b in zip(STAT_COLUMNS, row.tolist(), want_row.tolist()):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-6 * scale + 1e-12, nan_ok=True), k
    assert set(views) == set(want_views)
    for k in views:
        assert views[k].shape == want_views[k].shape, k
        np.testing.assert_allclose(views[k].numpy(), want_views[k].numpy(), rtol=view_rtol,
                                   atol=1e-6, err_msg=k)


def make(shape, scale, offset, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(shape, generator=gen) * scale + offset).to(dtype) for _ in range(3)]
    for x in xs:
        x.view(-1)[::5] = 0
    return xs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,batch_dim,scale,offset",
                         [c for c in CASES if c[1] is None])
def test_fast_parameters_equal_general(shape, batch_dim, scale, offset, dtype):
    xs = make(shape, scale, offset, dtype)
    want = [general(x, None, max_samples=2, max_neurons=7) for x in xs]
    got = fast_parameters([x.clone() for x in xs], max_neurons=7)   # stacked
    alone = fast_parameters([xs[0].clone()], max_neurons=7)         # one, unstacked
    for g, w in zip(got + alone, want + want[:1]):
        assert_same(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_batched_equals_general(dtype):
    # every batched case side by side: batch size 6 along their batch dimension
    pairs = []
    for k, (shape, batch_dim, scale, offset) in enumerate(CASES):
        if batch_dim is None:
            continue
        shape = list(shape)
        shape[batch_dim] = 6
        pairs += [(x, batch_dim) for x in make(tuple(shape), scale, offset, dtype, seed=k)]
    kw = dict(max_samples=2, max_neurons=7, max_items=5, max_values=30)
    want = [general(x, bd, **kw) for x, bd in pairs]
    got = fast_batched([(x.clone(), bd) for x, bd in pairs], **kw)
    alone = fast_batched([(pairs[0][0].clone(), pairs[0][1])], **kw)
    for g, w in zip(got + alone, want + want[:1]):
        assert_same(g, w)


def test_fast_keeps_precision_when_mean_dwarfs_spread():
    # mean/std = 1e4: E[x²] − E[x]² in float32 would lose every digit of the variance
    x = 1000.0 + 0.1 * torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    x[:, 3] = 1000.0                                           # a constant neuron
    ref = x.double().numpy()
    for (row, views), std in ((fast_batched([(x.clone(), 0)], 0)[0], ref.std(0)),
                              (fast_parameters([x.clone()])[0], ref.std(1))):
        assert row[STAT_COLUMNS.index("std")].item() == pytest.approx(ref.std(), rel=1e-4)
        np.testing.assert_allclose(views["neuron_std"].numpy(), std, rtol=1e-3, atol=1e-6)
    assert fast_batched([(x.clone(), 0)], 0)[0][1]["neuron_std"][3].item() == 0.0


def test_fast_refuses_non_finite_and_leaves_the_tensor_untouched():
    x = torch.randn(10, 4)
    x[3, 2] = float("inf")
    copy = x.clone()
    assert fast_batched([(copy, 0)], 2) is None and fast_parameters([copy]) is None
    assert torch.equal(copy, x)


def test_small_equals_general_on_every_kind():
    gen = torch.Generator().manual_seed(2)
    items = [(torch.randn(7, generator=gen), None), (torch.randn(5, 3, generator=gen), None),
             (torch.randn(6, 4, generator=gen), 0), (torch.randn(3, 6, 2, generator=gen), 1),
             (torch.tensor(2.5), None), (torch.randn(9, generator=gen), 0),
             (torch.tensor([1.0, float("nan"), -float("inf"), 0.0]), 0),
             (torch.tensor([3, 0, 4]), None), (torch.zeros(0, 3), 0)]
    got = small_summaries(items, max_samples=2, max_neurons=4, max_items=3)
    for (x, bd), g in zip(items, got):
        want = general(x, bd, max_samples=2, max_neurons=4, max_items=3)
        assert_same(g, want)


def test_summarise_shares_one_tensor_under_two_names():
    x = torch.randn(20, 300)   # large enough for the fast path
    caps = [Capture("a", "forward", 0, x, 0, False), Capture("b", "forward", 0, x, 0, False),
            Capture("c", "forward", 0, torch.randn(20, 300), 0, False)]
    released = []
    summary = summarise_captures(caps, 2, 64, False, True, released.extend)
    assert [k[0] for k in summary.keys] == ["a", "b", "c"]
    np.testing.assert_array_equal(summary.stats[0], summary.stats[1])
    assert len(released) == 2                                  # one buffer per tensor
    by = {(e[0], e[2]): e for e in summary.arrays}
    assert by[("a", "samples")][6:] == by[("b", "samples")][6:]  # same bytes, stored once
    for part, data in enumerate(summary.parts):
        assert max(e[7] + e[8] for e in summary.arrays if e[6] == part) == len(data)
    a = by[("a", "neuron_mean")]
    got = arrays.decode(a[4], a[5], summary.parts[a[6]][a[7]:a[7] + a[8]])
    np.testing.assert_allclose(got, x.double().numpy().mean(0)[:64], rtol=1e-5)
