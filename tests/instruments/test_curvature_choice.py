"""curvature="auto" chooses the Hessian-diagonal estimator by cost, and says why."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.curvature_choice import cnn  # the benchmark's model: one definition
from deepscope.instruments import suite
from deepscope.instruments.curvature import HessianOperator, OverBudget, exact_diagonal
from deepscope.instruments.quantities import EXACT_MAX_DIM, choose_diagonal
from deepscope.instruments.quantities.curvature import AUTO_FLOOR_S, AUTO_STEP_FACTOR
from deepscope.instruments.suite import Instruments


def test_choice_by_cost() -> None:
    # 2314 HVPs of 8.6 ms (the CNN of issue 14: ~20 s per step) against a 20 ms step
    mode, why = choose_diagonal(2314, 2, hvp_s=8.6e-3, forward_s=20e-3 / 3)
    assert mode == "hutchinson"
    assert "D=2314 HVPs, about 19.9 s per step (8.6 ms each)" in why
    assert f"more than {AUTO_STEP_FACTOR}× a training step (about 20 ms)" in why
    # the same model on a slow step: ten steps cover the exact diagonal
    assert choose_diagonal(2314, 2, hvp_s=8.6e-3, forward_s=1.0)[0] == "exact"
    # a small model: too fast to compare with its step, cheap in absolute terms
    mode, why = choose_diagonal(200, 2, hvp_s=4e-4, forward_s=1e-5, one_pass=64)
    assert mode == "exact" and f"or {AUTO_FLOOR_S * 1e3:.3g} ms" in why
    assert choose_diagonal(200, 2, hvp_s=6e-4, forward_s=1e-5, one_pass=64)[0] == "hutchinson"
    # as few batched passes as Hutchinson's: exact whatever the time (not even timed)
    mode, why = choose_diagonal(64, 2, hvp_s=math.nan, forward_s=1e-5, one_pass=64)
    assert mode == "exact" and "one batched backward pass" in why
    assert choose_diagonal(2, 2, hvp_s=math.nan, forward_s=1e-5)[0] == "exact"
    # too many parameters: not even timed
    mode, why = choose_diagonal(EXACT_MAX_DIM + 1, 2, hvp_s=math.nan, forward_s=1.0)
    assert mode == "hutchinson" and f"more than {EXACT_MAX_DIM}" in why


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))  # 23 parameters


def run_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int):
    inst = Instruments(model, ["HessTrace"])
    values = []
    with torch.no_grad():
        model(x)  # one warm-up forward: the first one pays one-off costs
    for step in range(steps):
        inst.start(step, "train")
        losses = F.cross_entropy(model(x), y, reduction="none")
        inst.loss(losses.mean(), per_sample=losses)
        losses.mean().backward()
        values += [v for v in inst.finish() if v.layer == ""]
    return values, inst.take_warnings(steps - 1)


def test_a_2k_parameter_cnn_gets_hutchinson_and_a_warning() -> None:
    torch.manual_seed(0)
    model = cnn()
    assert sum(p.numel() for p in model.parameters()) == 2458
    values, found = run_steps(model, torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)), 2)
    assert [v.meta["estimator"] for v in values] == ["hutchinson", "hutchinson"]
    # decided on the projected cost, or (a loaded machine: the forward is slow) when the
    # exact diagonal overran its budget after its first block of HVPs
    assert all("chose Hutchinson's estimator" in v.meta["choice"] and "D=2458 HVPs" in
               v.meta["choice"] for v in values)
    assert values[0].meta["choice"] == values[1].meta["choice"]  # decided once
    assert len(found) == 1 and found[0].quantities == ("HessTrace",)
    assert "chose Hutchinson's estimator" in found[0].message
    assert "curvature='exact'" in found[0].message


def test_a_tiny_model_still_gets_the_exact_diagonal_without_warning() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    # 12 HVPs: one batched pass, like Hutchinson's two
    values, found = run_steps(model, torch.randn(8, 2), torch.randint(0, 2, (8,)), 2)
    assert [(v.meta["estimator"], v.meta["samples"]) for v in values] == [("exact", 12)] * 2
    assert values[0].meta["choice"] == ("curvature='auto' chose the exact Hessian diagonal: "
                                        "its D=12 HVPs take one batched backward pass, as "
                                        "Hutchinson's 2 do")
    assert found == []


def test_a_one_pass_exact_diagonal_is_not_timed(monkeypatch) -> None:
    # decided by count: no timing, so a busy machine cannot change the choice
    monkeypatch.setattr(suite, "_hvp_seconds", lambda op: pytest.fail("timed"))
    monkeypatch.setattr(suite, "diagonal_budget", lambda forward_s: 1e-12)
    values, found = run_steps(mlp(), torch.randn(8, 4), torch.randint(0, 2, (8,)), 2)
    assert [(v.meta["estimator"], v.meta["samples"]) for v in values] == [("exact", 23)] * 2
    assert found == []


@pytest.mark.parametrize("mode", ["exact", "hutchinson"])
def test_an_explicit_mode_is_not_second_guessed(mode: str) -> None:
    torch.manual_seed(0)
    model = mlp()
    inst = Instruments(model, ["HessTrace"], curvature=mode)
    inst.start(0, "train")
    losses = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,)),
                             reduction="none")
    inst.loss(losses.mean(), per_sample=losses)
    losses.mean().backward()
    total = next(v for v in inst.finish() if v.layer == "")
    assert total.meta["estimator"] == mode and "choice" not in total.meta


def test_exact_diagonal_stops_when_it_overruns_its_budget() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 8), nn.Tanh(), nn.Linear(8, 2))  # 186: three blocks
    x, y = torch.randn(8, 20), torch.randint(0, 2, (8,))
    op = HessianOperator(F.cross_entropy(model(x), y), list(model.parameters()))
    assert op.batch_size < op.dim
    with pytest.raises(OverBudget, match="more than its budget of 1e-09 s") as info:
        exact_diagonal(op, budget_s=1e-9)
    assert info.value.projected_s > 0
    full = exact_diagonal(op, budget_s=1e9)
    torch.testing.assert_close(full.value, exact_diagonal(op).value, rtol=0, atol=0)


def test_auto_leaves_an_exact_diagonal_that_overruns(monkeypatch) -> None:
    # the projection says exact, the HVPs then take longer than the budget
    monkeypatch.setattr(suite, "_hvp_seconds", lambda op: 0.0)
    monkeypatch.setattr(suite, "diagonal_budget", lambda forward_s: 1e-9)
    torch.manual_seed(0)
    values, found = run_steps(cnn(), torch.randn(4, 1, 12, 12), torch.randint(0, 10, (4,)), 2)
    assert [v.meta["estimator"] for v in values] == ["hutchinson", "hutchinson"]
    assert "Hessian diagonal from step 0 on: the exact one (D=2458 HVPs) would have taken" \
        in values[1].meta["choice"]
    assert len(found) == 1 and "from step 0 on" in found[0].message
