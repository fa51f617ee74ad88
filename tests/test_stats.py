"""Statistics against a NumPy float64 recomputation; non-finite counts; view shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepscope
from deepscope.recorder.stats import array_views, tensor_stats
from deepscope.store.schema import STAT_COLUMNS


def numpy_stats(a: np.ndarray) -> dict[str, float]:
    a = a.astype(np.float64).ravel()
    fin = a[np.isfinite(a)]
    return {
        "numel": a.size, "mean": fin.mean(), "std": fin.std(), "abs_mean": np.abs(fin).mean(),
        "min": fin.min(), "max": fin.max(), "abs_max": np.abs(fin).max(),
        "norm": np.sqrt((fin ** 2).sum()), "zero_frac": (a == 0).mean(),
        "nan": np.isnan(a).sum(), "posinf": (a == np.inf).sum(), "neginf": (a == -np.inf).sum(),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("shape", [(7,), (5, 13), (3, 4, 5, 6)])
def test_stats_equal_numpy(dtype, shape):
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    x.view(-1)[::4] = 0
    got = dict(zip(STAT_COLUMNS, tensor_stats(x).tolist()))
    want = numpy_stats(x.float().numpy() if dtype == torch.float16 else x.numpy())
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert np.isnan(got["sv_max"])


def test_nonfinite_counted_and_ignored_by_statistics():
    x = torch.tensor([1.0, float("nan"), -2.0, float("inf"), float("-inf"), float("inf"), 0.0])
    got = dict(zip(STAT_COLUMNS, tensor_stats(x).tolist()))
    assert (got["nan"], got["posinf"], got["neginf"]) == (1, 2, 1)
    assert got["mean"] == pytest.approx(-1 / 3)
    assert (got["min"], got["max"], got["abs_max"]) == (-2.0, 1.0, 2.0)
    assert got["zero_frac"] == pytest.approx(1 / 7)


def test_all_nonfinite_gives_missing_not_inf():
    got = dict(zip(STAT_COLUMNS, tensor_stats(torch.full((3,), float("nan"))).tolist()))
    assert got["nan"] == 3 and np.isnan(got["min"]) and np.isnan(got["mean"])


def test_singular_value_of_2d_parameter():
    w = torch.randn(6, 4, dtype=torch.float64)
    got = dict(zip(STAT_COLUMNS, tensor_stats(w, singular_value=True).tolist()))
    assert got["sv_max"] == pytest.approx(np.linalg.svd(w.numpy(), compute_uv=False)[0])


def test_integer_and_bool_tensors():
    got = dict(zip(STAT_COLUMNS, tensor_stats(torch.tensor([1, 2, 3, 0])).tolist()))
    assert got["mean"] == 1.5 and got["zero_frac"] == 0.25
    # -min of uint8 wrapped (abs_max 253 for [3, 5]); bool tensors failed outright
    for x, want in ((torch.tensor([3, 5], dtype=torch.uint8), (3.0, 5.0, 5.0)),
                    (torch.tensor([True, False, True]), (0.0, 1.0, 1.0))):
        got = dict(zip(STAT_COLUMNS, tensor_stats(x).tolist()))
        assert (got["min"], got["max"], got["abs_max"]) == want


def test_view_shapes_batched_and_parameter():
    x = torch.randn(10, 3, 5)
    x[2, 1, 1] = float("nan")
    v = array_views(x, 0, max_samples=4, max_neurons=8)
    assert v["neuron_mean"].shape == (8,) and v["neuron_std"].shape == (8,)
    assert v["sample_mean"].shape == (10,) and v["sample_abs_max"].shape == (10,)
    assert v["samples"].shape == (4, 3, 5)
    flat = x.reshape(10, -1).double().numpy()
    np.testing.assert_allclose(v["neuron_mean"].numpy(), np.nanmean(flat[:, :8], 0), rtol=1e-5)
    np.testing.assert_allclose(v["sample_std"].numpy(), np.nanstd(flat, 1), rtol=1e-5)
    np.testing.assert_allclose(v["neuron_abs_max"].numpy(),
                               np.nanmax(np.abs(flat[:, :8]), 0), rtol=1e-6)
    w = torch.randn(6, 4)
    pv = array_views(w, None, max_samples=4)
    assert set(pv) == {"neuron_mean", "neuron_std", "neuron_abs_max"}
    np.testing.assert_allclose(pv["neuron_mean"].numpy(), w.numpy().mean(1), rtol=1e-5)
    assert array_views(torch.tensor(3.0), None, 4) == {}
    # batch dimension other than 0
    y = torch.randn(3, 7)
    yv = array_views(y, 1, max_samples=2)
    assert yv["samples"].shape == (2, 3) and yv["neuron_mean"].shape == (3,)


def test_recorded_stats_and_views_roundtrip(tmp_path):
    x = torch.randn(16, 20)
    x[0, 0] = float("inf")
    with deepscope.Scope(tmp_path, "r", schedule=1, max_samples=3) as scope:
        with scope.step(0) as rec:
            rec.tensor("x", x, role="input")
            rec.tensor("scalar", torch.tensor(2.5))
            rec.tensor("seq", torch.randn(4, 2), batch_dim=1)
    run = deepscope.open_run(tmp_path / "r")
    row = run.stats_wide("x").iloc[0]
    want = numpy_stats(x.numpy())
    for k, v in want.items():
        assert row[k] == pytest.approx(v, rel=1e-6), k
    np.testing.assert_array_equal(run.values("x", 0, view="samples"), x[:3].numpy())
    assert run.values("x", 0, view="neuron_mean").shape == (20,)
    assert run.values("seq", 0, view="samples").shape == (2, 4)  # batch dim 1 has 2 items
    assert run.views("scalar", 0) == []
    assert run.stats_wide("scalar").iloc[0]["mean"] == 2.5
    long = run.stats("x")
    assert list(long.columns) == ["step", "iteration", "tensor", "direction", "statistic",
                                  "value"]
    assert len(long) == len(STAT_COLUMNS)


@pytest.mark.parametrize("exact", [False, True])
def test_aggregate_views_precision(tmp_path, exact):
    x = torch.randn(32, 50) * 1e-6  # gradient-sized values must not underflow
    with deepscope.Scope(tmp_path, "p", schedule=1, exact_views=exact) as scope:
        with scope.step(0) as rec:
            rec.tensor("x", x)
    got = deepscope.open_run(tmp_path / "p").values("x", 0, view="neuron_mean")
    want = x.double().mean(0).numpy()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5 if exact else 4e-3)


@pytest.mark.parametrize("empty", [False, True], ids=["numpy-segments", "torch-segments"])
def test_small_summaries_equal_per_tensor_stats(empty):
    from deepscope.recorder.stats import small_summaries
    tensors = [torch.randn(7), torch.randn(3, 4) * 5 + 2, torch.tensor(2.5), torch.zeros(5),
               torch.tensor([1.0, float("nan"), float("inf"), -2.0, float("-inf")]),
               torch.full((2,), float("nan")), torch.tensor([1, 0, 3])]
    # an empty tensor has an empty segment, which NumPy's reduceat cannot take
    tensors += [torch.empty(0)] if empty else []
    got = [row.numpy() for row, _ in small_summaries([(t, None) for t in tensors], 0)]
    for row, t in zip(got, tensors):
        want = tensor_stats(t).numpy()
        np.testing.assert_allclose(row, want, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("values", [
    np.array([1.5, -2.0, 0.0, 3.25, 0.0], dtype=np.float32),
    np.array([1.0, np.nan, np.inf, -np.inf, -4.0, 0.0], dtype=np.float32),
    np.array([np.nan, np.inf], dtype=np.float32)])
def test_gui_item_stats_equal_the_recorders(values):
    """The GUI's statistics of one stored batch item (NumPy, no torch) are the recorder's."""
    from deepscope.gui.panels import item_stats
    want = tensor_stats(torch.from_numpy(values)).numpy()
    np.testing.assert_allclose(item_stats(values), want, rtol=1e-12, equal_nan=True)
