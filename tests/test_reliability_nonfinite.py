"""Non-finite data never breaks a statistic or a view: NaN/±Inf are recorded, counted beside
every statistic, kept exactly in stored samples, and read back."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import deepscope

NAN, INF = float("nan"), float("inf")


def stats(run: deepscope.Run, tensor: str, direction: str = "forward") -> dict[str, float]:
    return run.stats_wide(tensor, direction=direction).iloc[0].to_dict()


@pytest.mark.parametrize("exact_views", [False, True])
def test_nonfinite_tensors_are_counted_and_read_back(tmp_path, exact_views):
    with deepscope.Scope(tmp_path, "r", schedule=1, exact_views=exact_views) as scope:
        with scope.step(0) as rec:
            rec.tensor("mixed", torch.tensor([[1.0, NAN, 3.0], [INF, -INF, 2.0]]), role="input")
            rec.tensor("all_nan", torch.full((3,), NAN))
            rec.tensor("half", torch.tensor([60000.0, 1.0], dtype=torch.float16) * 2)  # overflow
            rec.tensor("bf16", torch.tensor([NAN, 1.0], dtype=torch.bfloat16))
            w = torch.tensor([0.0, 1.0], requires_grad=True)
            rec.tensor("w", w)
            loss = torch.log(w).sum()  # -inf, and d/dw log(w) = +inf at 0
            rec.loss(loss)
            loss.backward()
            rec.kpi("nan_kpi", NAN)
    run = deepscope.open_run(tmp_path / "r")
    mixed = stats(run, "mixed")
    assert (mixed["numel"], mixed["nan"], mixed["posinf"], mixed["neginf"]) == (6, 1, 1, 1)
    # statistics over the finite elements 1, 3, 2; the counts say what was left out
    assert (mixed["mean"], mixed["min"], mixed["max"], mixed["abs_max"]) == (2, 1, 3, 3)
    assert mixed["std"] == pytest.approx(math.sqrt(2 / 3))
    assert mixed["norm"] == pytest.approx(math.sqrt(14))
    samples = run.values("mixed", 0, view="samples")  # exact values, non-finite included
    np.testing.assert_array_equal(samples, [[1.0, NAN, 3.0], [INF, -INF, 2.0]])
    for view in run.views("mixed", 0):  # every aggregate view decodes with its shape
        assert run.values("mixed", 0, view=view).shape in {(3,), (2,), (2, 3)}
    all_nan = stats(run, "all_nan")
    assert all_nan["nan"] == 3 and math.isnan(all_nan["mean"]) and math.isnan(all_nan["max"])
    assert stats(run, "half")["posinf"] == 1 and stats(run, "half")["mean"] == 2
    assert stats(run, "bf16")["nan"] == 1 and stats(run, "bf16")["mean"] == 1
    assert stats(run, "w", "grad")["posinf"] == 1
    assert stats(run, "loss")["neginf"] == 1
    kpis = run.kpis().set_index("name")["value"]
    assert math.isnan(kpis["nan_kpi"]) and kpis["loss"] == -INF


def test_instruments_count_nonfinite_gradients(tmp_path):
    """An infinite per-sample gradient (sqrt at 0) is counted by the histogram and makes the
    gradient norm non-finite, on every step, without stopping training."""
    lin = torch.nn.Linear(2, 1)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.fill_(0.0)
    x = torch.tensor([[0.0, 0.0], [1.0, 2.0], [4.0, 0.0]])
    with deepscope.Scope(tmp_path, "r", schedule=1,
                         instruments=["GradNorm", "GradHist1d"]) as scope:
        scope.watch(lin)
        for step in range(2):
            with scope.step(step) as rec:
                losses = lin(x)[:, 0].sqrt()
                rec.loss(losses.mean(), per_sample=losses)
                lin.zero_grad()
                losses.mean().backward()
    run = deepscope.open_run(tmp_path / "r")
    norms = run.quantities("GradNorm", layer="bias")
    assert list(norms["step"]) == [0, 1] and not np.isfinite(norms["value"]).any()
    for step in (0, 1):
        _, meta = run.histogram("GradHist1d", step, "bias")
        assert meta["posinf"] + meta["nan"] > 0
    assert stats(run, "bias", "grad")["posinf"] == 1


def test_a_nan_loss_does_not_stop_training_with_instruments(tmp_path):
    """A diverged step is what deepscope is for: the instruments must not raise on it."""
    lin = torch.nn.Linear(2, 1)
    with deepscope.Scope(tmp_path, "r", schedule=1, instruments=["GradNorm"]) as scope:
        scope.watch(lin)
        with scope.step(0) as rec:
            losses = lin(torch.tensor([[NAN, 1.0], [1.0, 2.0]]))[:, 0] ** 2
            rec.loss(losses.mean(), per_sample=losses)
            losses.mean().backward()
    assert math.isnan(deepscope.open_run(tmp_path / "r").kpis("loss")["value"].item())


def test_an_empty_tensor_does_not_lose_the_step(tmp_path):
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        with scope.step(0) as rec:
            rec.tensor("empty", torch.zeros(0, 4), role="input")
            rec.tensor("x", torch.ones(2))
    run = deepscope.open_run(tmp_path / "r")
    assert stats(run, "empty")["numel"] == 0 and stats(run, "x")["mean"] == 1


def test_a_neuron_without_finite_values_is_not_shown_as_zero(tmp_path):
    with deepscope.Scope(tmp_path, "r", schedule=1, exact_views=True) as scope:
        with scope.step(0) as rec:
            rec.tensor("x", torch.tensor([[1.0, NAN], [2.0, INF]]), role="input")
    values = deepscope.open_run(tmp_path / "r").values("x", 0, view="neuron_mean")
    assert values[0] == 1.5 and not np.isfinite(values[1])
