"""What watch() is given shows up under the names the user sees (issue 21, item 6; issue 18,
item 6): tensors, quantity layers, findings and warnings carry the recorded names, and
watch(optimizer=) logs the learning rate that the dashboard's Hyperparameters panel draws."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deepscope
from deepscope.dashboard.data import DashboardData
from deepscope.errors import DeepscopeWarning


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


def _named_head_run(path) -> deepscope.Run:
    """watch(model[2], name="head") with the health check and the per-sample engine on; the
    head (BatchNorm in train mode) earns an instrument warning, and its weight's gradient
    turns infinite at step 2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.BatchNorm1d(6))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deepscope.Scope(path, "r", schedule=1, instruments=["GradNorm", "NormTest"],
                         anomalies="check") as scope:
        scope.watch(model[2], name="head", optimizer=opt)
        for step in range(4):
            with scope.step(step) as rec:
                x, y = torch.randn(8, 4), torch.randint(0, 6, (8,))
                losses = nn.functional.cross_entropy(model(x), y, reduction="none")
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                loss = losses.mean()
                if step == 2:
                    loss = loss + model[2].weight.sum() * float("inf")
                loss.backward()
                opt.step()
    return deepscope.open_run(path / "r")


def test_a_named_watch_names_tensors_quantities_findings_and_warnings_alike(tmp_path) -> None:
    with pytest.warns(DeepscopeWarning, match="BatchNorm1d 'head'"):
        run = _named_head_run(tmp_path)
    with run:
        tensors = set(run.tensors()["name"])
        layers = set(run.quantities("GradNorm")["layer"])
        findings = run.anomalies()
        warned = list(run.warnings()["location"])
    assert {"head.weight", "head.bias"} <= tensors
    assert layers == {"", "head.weight", "head.bias"}
    assert list(findings["tensor"]) == ["head.weight"]
    assert "parameter head.weight" in findings["message"].iloc[0]
    assert warned == ["BatchNorm1d 'head'"]  # the module under its recorded name, not '<model>'


def test_the_graph_links_a_node_to_its_quantities_by_the_recorded_names(tmp_path) -> None:
    from deepscope.gui import graph_view
    from deepscope.gui.data import ProjectData
    from deepscope.gui.selection import Request, resolve
    from deepscope.gui.tabs.graph import _node_values

    with pytest.warns(DeepscopeWarning):
        _named_head_run(tmp_path).close()
    project = ProjectData(tmp_path)
    rd = project.run("r")
    sel = {**resolve(project, Request(), None)[0].as_dict(), "step": 1}
    layout = graph_view.build_layout(rd.graph(1, 0))
    node_of = {t: n for n, ts in layout.members.items() for t in ts}
    q = rd.quantities("GradNorm")
    expected = q[(q["step"] == 1) & (q["layer"] != "")]["value"].max()
    assert _node_values(rd, sel, node_of, "q:GradNorm")[0] == {"head": pytest.approx(expected)}
    # exact: no suffix guess links "head.weight" to another model's "net.head.weight"
    assert _node_values(rd, sel, {"net.head.weight": "net"}, "q:GradNorm")[0] == {}


def test_a_tensor_learning_rate_is_logged_as_at_the_start_of_each_step(tmp_path):
    """A tensor lr (capturable optimisers) is copied at the step's start, not read there."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.5))
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.never, anomalies=False) as scope:
        scope.watch(model, optimizer=opt)
        for step in range(2):
            with scope.step(step):
                opt.param_groups[0]["lr"].mul_(0.5)  # changed in place during the step
    lrs = deepscope.open_run(tmp_path / "r").kpis("learning_rate")["value"].tolist()
    assert lrs == [0.5, 0.25]
