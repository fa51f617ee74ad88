"""Cockpit's API over deepscope: the seed's Cockpit example runs with only its import lines
changed, and its values are deepscope's own."""

from __future__ import annotations

import contextlib
import json
import math
import tempfile

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

import deepscope
from deepscope.compat.backpack import extend
from deepscope.compat.cockpit import Cockpit, CockpitPlotter, quantities
from deepscope.compat.cockpit.utils import schedules
from deepscope.compat.cockpit.utils.configuration import configuration
from deepscope.instruments.config import CONFIGURATIONS, QUANTITY_NAMES

BATCH, STEPS = 8, 5
ECONOMY_NAMES = {"Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss", "NormTest",
                 "OrthoTest", "UpdateSize"}
FULL_NAMES = ECONOMY_NAMES | {"TICDiag", "HessTrace", "HessMaxEV", "GradHist2d"}


def synthetic_fmnist(batches: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fashion-MNIST-shaped batches (1×28×28 inputs, 10 classes), from their own generator."""
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,),
                                                                       generator=g))
            for _ in range(batches)]


# The seed's Cockpit example, verbatim but for the import lines (and the article's lost
# indentation). It rebinds the name Cockpit to the instance, as the seed does, so it runs as
# a script of its own; `fmnist_data` is given to it (synthetic, no download).
SEED_EXAMPLE = """
import torch
from deepscope.compat.backpack import extend
from deepscope.compat.cockpit import Cockpit, CockpitPlotter
from deepscope.compat.cockpit.utils.configuration import configuration

# Build Fashion-MNIST classifier
fmnist_data = fmnist_data()
model = extend(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)))
loss_fn = extend(torch.nn.CrossEntropyLoss(reduction="mean"))
individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")

# Create SGD Optimizer
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
# Create Cockpit and a plotter
Cockpit = Cockpit(model.parameters(), quantities=configuration("full"))
plotter = CockpitPlotter()

# Main training loop
max_steps, global_step = 5, 0
for inputs, labels in iter(fmnist_data):
    opt.zero_grad()
    # forward pass
    outputs = model(inputs)
    loss = loss_fn(outputs, labels)
    losses = individual_loss_fn(outputs, labels)
    # backward pass
    with Cockpit(
        global_step,
        info={
            "batch_size": inputs.shape[0],
            "individual_losses": losses,
            "loss": loss,
            "optimizer": opt,
        },
    ):
        loss.backward(create_graph=Cockpit.create_graph(global_step))
    # optimizer step
    opt.step()
    global_step += 1
    print(f"Step: {global_step:5d} | Loss: {loss.item():.4f}")
    plotter.plot(Cockpit)
    if global_step >= max_steps:
        break
plotter.plot(Cockpit, block=True)
"""


def run_seed_example() -> dict:
    """Run the seed's example as a script; returns its namespace."""
    namespace = {"__name__": "cockpit_seed_example", "fmnist_data": synthetic_fmnist}
    exec(compile(SEED_EXAMPLE, "cockpit_seed_example.py", "exec"), namespace)
    return namespace


def run_native(path) -> deepscope.Run:
    """The same training, data and initial weights, recorded with deepscope's own API."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scope = deepscope.Scope(path, "native", schedule=deepscope.never, instruments="full",
                            instrument_schedule=deepscope.every(1), anomalies=False)
    scope.watch(model, optimizer=opt)
    for step, (inputs, labels) in enumerate(synthetic_fmnist()[:STEPS]):
        with scope.step(step) as rec:
            opt.zero_grad()
            outputs = model(inputs)
            losses = torch.nn.functional.cross_entropy(outputs, labels, reduction="none")
            loss = losses.mean()
            rec.loss(loss, per_sample=losses)
            loss.backward()
            opt.step()
    scope.close()
    return deepscope.open_run(scope.run_dir)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Cockpit's default run folder (a new temporary folder) inside tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _tiny(names, steps: int, start: int = 0, **cockpit_kwargs):
    """A 4 → 3 linear model trained `steps` steps under a Cockpit tracking `names`."""
    torch.manual_seed(0)
    model = extend(torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=names, **cockpit_kwargs)
    for step in range(start, start + steps):
        x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        opt.zero_grad()
        out = model(x)
        losses = torch.nn.functional.cross_entropy(out, y, reduction="none")
        with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses,
                                 "optimizer": opt}):
            losses.mean().backward()
        opt.step()
    return cockpit, model


def test_seed_example_matches_a_native_run(in_tmp, capsys):
    seed = run_seed_example()
    cockpit, plotter = seed["Cockpit"], seed["plotter"]
    assert "Step:     5 | Loss:" in capsys.readouterr().out
    output = cockpit.get_output()
    assert sorted(output) == list(range(STEPS))
    for step in range(STEPS):
        # α of the last step needs the next step's batch, which never came
        assert set(output[step]) == FULL_NAMES - ({"Alpha"} if step == STEPS - 1 else set())
        for name, value in output[step].items():
            if name in ("GradHist1d", "GradHist2d"):
                assert value["hist"].sum() > 0
            else:
                assert np.all(np.isfinite(value)), (step, name, value)
    native = run_native(in_tmp)
    with deepscope.open_run(cockpit.run_path) as compat:
        ours, theirs = compat.quantities(), native.quantities()
        key = ["step", "name", "layer"]
        assert ours[key].values.tolist() == theirs[key].values.tolist()
        np.testing.assert_allclose(ours["value"], theirs["value"], rtol=1e-6, equal_nan=True)
        for step in range(STEPS):
            for name in ("GradHist1d", "GradHist2d"):
                np.testing.assert_array_equal(compat.histogram(name, step)[0],
                                              native.histogram(name, step)[0])
    # Cockpit's output format: per-parameter lists in params order, floats, histograms
    for step in range(STEPS):
        for name in ("GradNorm", "UpdateSize", "HessTrace"):
            per_layer = native.quantities(name)
            per_layer = per_layer[per_layer["step"] == step].set_index("layer")["value"]
            assert output[step][name] == pytest.approx([per_layer["1.weight"],
                                                        per_layer["1.bias"]])
        loss = native.quantities("Loss")
        assert output[step]["Loss"] == pytest.approx(loss["value"][loss["step"] == step].item())
    hist2d = output[0]["GradHist2d"]
    assert hist2d["hist"].shape == (40, 50) and [len(e) for e in hist2d["edges"]] == [41, 51]
    native.close()
    # the plotter redrew one figure: every panel drawn, none "not tracked"
    labels = {ax.get_label() for ax in plotter.fig.axes}
    assert {"panel:alpha", "panel:hist2d", "panel:hessmaxev", "panel:performance"} <= labels
    assert not [t for ax in plotter.fig.axes for t in ax.texts
                if "not tracked" in t.get_text() or "cannot draw" in t.get_text()]
    plt.close(plotter.fig)  # the seed's plotter made a pyplot figure


def test_quantity_schedules_are_honoured(in_tmp):
    cockpit, _ = _tiny([quantities.GradNorm(track_schedule=schedules.linear(2)),
                        quantities.Loss, "UpdateSize"], steps=5)
    output = cockpit.get_output()
    assert [s for s in output if "GradNorm" in output[s]] == [0, 2, 4]
    assert [s for s in output if "Loss" in output[s]] == [0, 1, 2, 3, 4]
    assert [s for s in output if "UpdateSize" in output[s]] == [0, 1, 2, 3, 4]
    assert len(output[2]["GradNorm"]) == 2  # weight, bias
    grad_norm = cockpit.quantities[0]
    assert sorted(grad_norm.get_output()) == [0, 2, 4]
    with deepscope.open_run(cockpit.run_path) as run:
        assert set(run.kpis()["name"]) == {"loss", "learning_rate"}


def test_configuration_and_schedules():
    for label in ("economy", "business", "full"):
        configured = configuration(label)
        assert {q.name for q in configured} == set(CONFIGURATIONS[label])
        assert all(q.should_compute(7) for q in configured)
    assert {q.name for q in configuration("full")} == FULL_NAMES
    with pytest.raises(ValueError, match="unknown configuration 'first'"):
        configuration("first")
    assert {c.__name__ for c in quantities.Quantity.__subclasses__()} == set(QUANTITY_NAMES)
    every_third = schedules.linear(3, offset=1)
    assert [s for s in range(10) if every_third(s)] == [1, 4, 7]
    log_spaced = schedules.logarithmic(0, 2, steps=3)
    assert [s for s in range(200) if log_spaced(s)] == [0, 1, 10, 100]
    assert not quantities.Alpha(track_schedule=schedules.linear(5)).should_compute(3)
    assert quantities.Alpha(2).should_compute(4)  # Cockpit's older track_interval
    with pytest.warns(UserWarning, match="bins, range are not applied"):
        quantities.GradHist1d(bins=10, range=(-1, 1))


def test_write_and_log(in_tmp):
    cockpit, _ = _tiny(["Loss", "GradNorm"], steps=2)
    cockpit.log(1, 0, 0.5, 0.6, None, 0.8, 0.7, None, 0.1)
    cockpit.write(str(in_tmp / "logs" / "run"))
    written = json.loads((in_tmp / "logs" / "run.json").read_text())
    assert sorted(written) == ["0", "1"]
    assert written["1"]["valid_loss"] == 0.6 and written["1"]["test_loss"] is None
    assert written["0"]["Loss"] == pytest.approx(cockpit.get_output()[0]["Loss"])
    cockpit.flush()
    with deepscope.open_run(cockpit.run_path) as run:
        kpis = run.kpis()
    logged = kpis[kpis["step"] == 1].set_index("name")["value"]
    assert logged["valid_accuracy"] == 0.7 and "test_loss" not in logged


def test_misnumbered_steps_still_record(in_tmp):
    with pytest.warns(UserWarning, match="Count global_step up by one per step, starting at 0"):
        cockpit, _ = _tiny(["Loss", "Distance", "GradNorm"], steps=3, start=1)
    output = cockpit.get_output()
    assert sorted(output) == [1, 2, 3]
    assert "GradNorm" not in output[1]  # its forward pass was announced as step 0
    assert all("GradNorm" in output[s] and math.isfinite(output[s]["Loss"]) for s in (2, 3))


def test_model_lookup_and_errors(in_tmp):
    orphan = torch.nn.Linear(5, 2)
    with pytest.raises(ValueError, match="wrap the model with extend"):
        Cockpit(orphan.parameters(), quantities=["Loss"])
    frozen = torch.nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        Cockpit(frozen.parameters())
    with pytest.raises(ValueError, match="unknown quantity 'GradientNorm'"):
        Cockpit(orphan.parameters(), quantities=["GradientNorm"], model=orphan)
    cockpit = Cockpit(orphan.parameters(), quantities=["Loss"], model=orphan)
    assert cockpit.create_graph(0) is False
    orphan(torch.randn(3, 5))  # the forward pass opens the first step
    with pytest.raises(ValueError, match="after tracking started"):
        cockpit.add(quantities.GradNorm())
    cockpit.close()


def test_failed_step_and_plotter_files(in_tmp):
    torch.manual_seed(0)
    model = extend(torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=["Loss", "GradNorm"])
    for step in range(3):
        x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        opt.zero_grad()
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        with pytest.raises(RuntimeError) if step == 1 else contextlib.nullcontext():
            with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses,
                                     "optimizer": opt}):
                if step == 1:
                    raise RuntimeError("the user's backward failed")
                losses.mean().backward()
            opt.step()
    assert sorted(cockpit.get_output()) == [0, 2]  # the failed step left nothing half-done
    plotter = CockpitPlotter()
    with pytest.raises(ValueError, match="specify savedir"):
        plotter.plot(cockpit, show_plot=False, save_plot=True)
    plotter.plot(cockpit, show_plot=False, save_plot=True, savedir=in_tmp / "log",
                 savename_append="_end")
    assert (in_tmp / "log__primary_end.png").stat().st_size > 10_000
    plotter.plot(str(cockpit.run_path), show_plot=False, discard=0, plot_title="early")
    assert plotter.fig.get_suptitle() == "early"
    gradnorm = next(line for ax in plotter.fig.axes for line in ax.get_lines()
                    if line.get_label().startswith("GradNorm"))
    assert list(gradnorm.get_xdata()) == [0]
    cockpit.close()
