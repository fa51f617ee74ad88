"""What watch() is given shows up under the names the user sees (issue 21, item 6): quantity
layers are the recorded parameter names, and watch(optimizer=) logs the learning rate that
the dashboard's Hyperparameters panel draws."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deepscope
from deepscope.dashboard.data import DashboardData


def _train(path, *, log_lr: bool = False, steps: int = 4) -> deepscope.Run:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with deepscope.Scope(path, "r", schedule=1, instruments=["GradNorm"]) as scope:
        scope.watch(model[2], name="head", optimizer=opt)
        for step in range(steps):
            with scope.step(step) as rec:
                x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
                losses = nn.functional.cross_entropy(model(x), y, reduction="none")
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
                if log_lr:
                    rec.kpi("learning_rate", 42.0)
            sched.step()
    return deepscope.open_run(path / "r")


def test_quantity_layers_are_the_recorded_parameter_names(tmp_path) -> None:
    with _train(tmp_path) as run:
        layers = set(run.quantities("GradNorm")["layer"])
        tensors = set(run.tensors()["name"])
    assert layers == {"", "head.weight", "head.bias"}
    assert layers - {""} <= tensors


def test_watch_optimizer_logs_the_learning_rate_of_each_step(tmp_path) -> None:
    with _train(tmp_path) as run:
        lr = run.kpis("learning_rate")
        assert list(lr["step"]) == [0, 1, 2, 3]
        assert list(lr["value"]) == pytest.approx([0.1, 0.1, 0.05, 0.05])
        series = DashboardData.load(run).series("learning_rate")
    assert series is not None and len(series.values) == 4


def test_a_learning_rate_the_step_logs_itself_wins(tmp_path) -> None:
    with _train(tmp_path, log_lr=True) as run:
        assert list(run.kpis("learning_rate")["value"]) == [42.0] * 4
