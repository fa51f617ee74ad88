"""Cockpit's API over deepscope: the seed's Cockpit example runs with only its import lines
changed, and its values are deepscope's own."""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import warnings

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
from deepscope.dashboard.figure import FIGSIZE
from deepscope.instruments.config import CONFIGURATIONS, QUANTITY_NAMES

BATCH, STEPS = 8, 5
# Cockpit's GradHist2d defaults in deepscope's (parameter, gradient) axis order
COCKPIT_HIST2D = {"hist2d_bins": (50, 40), "hist2d_range": ((-2, 2), (-1, 1))}
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
                            instrument_schedule=deepscope.every(1), anomalies=False,
                            # Cockpit's full computes HessMaxEV at every step
                            instrument_options={**COCKPIT_HIST2D, "max_ev_every": 1})
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
        # α and the update size of the last step need the next step, which never came
        assert set(output[step]) == FULL_NAMES - ({"Alpha", "UpdateSize"} if step == STEPS - 1
                                                  else set())
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
            if name not in output[step]:
                continue
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
    # Cockpit shows step t's update once step t + 1 is tracked; the run stores step 4 too
    assert [s for s in output if "UpdateSize" in output[s]] == [0, 1, 2, 3]
    assert len(output[2]["GradNorm"]) == 2  # weight, bias
    grad_norm = cockpit.quantities[0]
    assert sorted(grad_norm.get_output()) == [0, 2, 4]
    cockpit.flush()
    with deepscope.open_run(cockpit.run_path) as run:
        assert set(run.kpis()["name"]) == {"loss", "learning_rate"}
        stored = run.quantities("UpdateSize")
        assert sorted(set(stored["step"])) == [0, 1, 2, 3, 4]


def test_configuration_and_schedules():
    for label in ("economy", "business", "full"):
        configured = configuration(label)
        assert {q.name for q in configured} == set(CONFIGURATIONS[label])
        assert all(q.should_compute(7) for q in configured)
    assert {q.name for q in configuration("full")} == FULL_NAMES
    with pytest.raises(ValueError, match="unknown configuration 'first'"):
        configuration("first")
    computed = {n for n in quantities.__all__ if getattr(quantities, n).instrument}
    assert computed - {"Quantity"} == set(QUANTITY_NAMES)
    every_third = schedules.linear(3, offset=1)
    assert [s for s in range(10) if every_third(s)] == [1, 4, 7]
    log_spaced = schedules.logarithmic(0, 2, steps=3)
    assert [s for s in range(200) if log_spaced(s)] == [0, 1, 10, 100]
    assert not quantities.Alpha(track_schedule=schedules.linear(5)).should_compute(3)
    assert quantities.Alpha(2).should_compute(4)  # Cockpit's older track_interval
    with pytest.warns(UserWarning, match="TICDiag options curvature, epsilon are not applied"):
        quantities.TICDiag(curvature="diag_ggn_mc", epsilon=1e-3)


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
    # Cockpit 1.0.2: savedir/<savename>__primary[__<savename_append>].png, savefig_kwargs
    plotter.plot(cockpit, show_plot=False, save_plot=True, savedir=in_tmp / "log",
                 savename_append="end")
    assert (in_tmp / "log" / "cockpit__primary__end.png").stat().st_size > 10_000
    assert not (in_tmp / "log__primary_end.png").exists()
    plotter.plot(cockpit, show_plot=False, save_plot=True, savedir=in_tmp / "log",
                 savename="small", savefig_kwargs={"dpi": 10})
    png = (in_tmp / "log" / "small__primary.png").read_bytes()
    assert png[:4] == b"\x89PNG" and int.from_bytes(png[16:20], "big") == round(FIGSIZE[0] * 10)
    plotter.plot(str(cockpit.run_path), show_plot=False, discard=0, plot_title="early")
    assert plotter.fig.get_suptitle() == "early"
    gradnorm = next(line for ax in plotter.fig.axes for line in ax.get_lines()
                    if line.get_label().startswith("GradNorm"))
    assert list(gradnorm.get_xdata()) == [0]
    cockpit.close()


def _train(qs, steps: int, *, make_opt=None, loss_fn=None, each_step=None, in_dim=4, out=3):
    """Like `_tiny`, with a chosen optimiser, per-sample loss (outputs, y) -> (B,) and a
    callback each_step(step, cockpit, model, x, y, theta) run right after `opt.step()`
    (theta: the parameters the step's gradients were taken at)."""
    torch.manual_seed(0)
    model = extend(torch.nn.Linear(in_dim, out))
    opt = (make_opt or (lambda p: torch.optim.SGD(p, lr=0.1)))(model.parameters())
    loss_fn = loss_fn or (lambda o, y: torch.nn.functional.cross_entropy(o, y, reduction="none"))
    cockpit = Cockpit(model.parameters(), quantities=qs)
    for step in range(steps):
        x, y = torch.randn(6, in_dim), torch.randint(0, out, (6,))
        opt.zero_grad()
        losses = loss_fn(model(x), y)
        with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses,
                                 "optimizer": opt}):
            losses.mean().backward()
        theta = [p.detach().clone() for p in model.parameters()]
        opt.step()
        if each_step is not None:
            each_step(step, cockpit, model, x, y, theta)
    return cockpit, model


def _per_sample_grads(model, x, y, theta) -> np.ndarray:
    """gᵢ = ∇ℓᵢ at θ by a loop over samples (float64), (B, D) with D in params order."""
    ref = torch.nn.Linear(model.in_features, model.out_features).double()
    with torch.no_grad():
        ref.weight.copy_(theta[0]), ref.bias.copy_(theta[1])
    rows = []
    for xi, yi in zip(x.double(), y):
        loss = torch.nn.functional.cross_entropy(ref(xi[None]), yi[None])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            loss, list(ref.parameters()))]).numpy())
    return np.stack(rows)


def test_quantity_outputs_fill_after_each_step(in_tmp):
    """#22.2: each quantity object shows its values after each tracked step, as Cockpit's."""
    grad_norm, update, loss = quantities.GradNorm(), quantities.UpdateSize(), quantities.Loss()
    seen = []

    def check(step, cockpit, model, x, y, theta):
        seen.append((sorted(grad_norm.get_output()), sorted(update.get_output()),
                     sorted(loss.get_output())))
        g = _per_sample_grads(model, x, y, theta).mean(0)
        weight = g[:model.weight.numel()]
        assert grad_norm.get_output()[step][0] == pytest.approx(np.linalg.norm(weight),
                                                                rel=1e-5)

    cockpit, _ = _train([grad_norm, update, loss], 3, each_step=check)
    # UpdateSize of step t appears once step t + 1 is tracked (Cockpit's two-step quantity)
    assert seen == [([0], [], [0]), ([0, 1], [0], [0, 1]), ([0, 1, 2], [0, 1], [0, 1, 2])]
    assert cockpit.get_output()[1]["GradNorm"] == grad_norm.get_output()[1]


def test_update_size_steps_match_cockpit(in_tmp):
    """#22.8: tracked at steps 2, 3, 4 of 0..4: Cockpit shows [2, 3] (step 5 never came)."""
    cockpit, _ = _train([quantities.UpdateSize(track_schedule=lambda s: s >= 2)], 5)
    assert sorted(cockpit.get_output()) == [2, 3]
    cockpit.flush()
    with deepscope.open_run(cockpit.run_path) as run:  # deepscope's run keeps step 4's
        assert sorted(set(run.quantities("UpdateSize")["step"])) == [2, 3, 4]


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=0.01),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-4),
], ids=["adam", "momentum", "weight_decay"])
@pytest.mark.parametrize("name", ["EarlyStopping", "CABS"])
def test_sgd_only_quantities_refuse_other_optimizers(in_tmp, make_opt, name):
    """#22.4: Cockpit raises ValueError for CABS / EarlyStopping with another optimiser."""
    with pytest.raises(ValueError, match=f"{name} only supports zero-momentum SGD"):
        _train([name, "Loss"], 2, make_opt=make_opt)
    cockpit, _ = _train([name], 2)  # plain SGD: values
    assert [math.isfinite(v[name]) for v in cockpit.get_output().values()] == [True, True]


def test_histogram_bins_and_range_are_applied(in_tmp):
    """#22.5: GradHist1d / GradHist2d use the bins and range asked for; GradHist2d's axes
    are (gradient, parameter) as Cockpit's; 1-D outliers go to the edge bins as Cockpit's."""
    h1 = quantities.GradHist1d(bins=7, range=(-0.1, 0.1))
    h2 = quantities.GradHist2d(bins=(8, 5), range=((-0.2, 0.2), (-0.6, 0.6)),
                               keep_individual=True)
    expected = {}

    def reference(step, cockpit, model, x, y, theta):
        grads = _per_sample_grads(model, x, y, theta)
        params = np.concatenate([t.reshape(-1).double().numpy() for t in theta])
        pairs_g = grads.reshape(-1)
        pairs_p = np.broadcast_to(params, grads.shape).reshape(-1)
        one, _ = np.histogram(np.clip(pairs_g, -0.1, 0.1), bins=7, range=(-0.1, 0.1))
        n_weight = model.weight.numel()
        two = cockpit_hist2d(pairs_g, pairs_p)
        bias = cockpit_hist2d(grads[:, n_weight:].reshape(-1),
                              np.broadcast_to(params[n_weight:], grads[:, n_weight:].shape
                                              ).reshape(-1))
        inside = (np.abs(pairs_g) < 0.2) & (np.abs(pairs_p) < 0.6)
        expected[step] = one, two, bias, int(inside.sum())

    def cockpit_hist2d(g, p):  # each axis clamped to its outer bins' centres, as Cockpit does
        g, p = np.clip(g, -0.2 + 0.025, 0.2 - 0.025), np.clip(p, -0.6 + 0.12, 0.6 - 0.12)
        return np.histogram2d(g, p, bins=(8, 5), range=((-0.2, 0.2), (-0.6, 0.6)))[0]

    cockpit, _ = _train([h1, h2], 2, each_step=reference)
    for step, (one, two, bias, inside) in expected.items():
        assert 0 < inside < two.sum()  # pairs inside and outside the ranges
        got1, got2 = h1.get_output()[step], h2.get_output()[step]
        np.testing.assert_array_equal(got1["hist"], one)
        np.testing.assert_allclose(got1["edges"], np.linspace(-0.1, 0.1, 8))
        assert got2["hist"].shape == (8, 5)
        np.testing.assert_array_equal(got2["hist"], two)
        np.testing.assert_allclose(got2["edges"][0], np.linspace(-0.2, 0.2, 9))
        np.testing.assert_allclose(got2["edges"][1], np.linspace(-0.6, 0.6, 6))
        assert got2["param_groups"] == 2
        np.testing.assert_array_equal(got2["param_1"]["hist"], bias)


def test_bin_adaptation_module_is_importable(in_tmp):
    """#22.6: Cockpit code importing bin_adaptation runs; an adaptation warns it is not
    applied, none stays silent."""
    from deepscope.compat.cockpit.quantities.bin_adaptation import (
        GradAbsMax,
        NoAdaptation,
        ParamAbsMax,
    )
    assert quantities.bin_adaptation.GradAbsMax is GradAbsMax
    with pytest.warns(UserWarning, match="GradHist1d options adapt are not applied"):
        quantities.GradHist1d(adapt=GradAbsMax(schedules.linear(1), padding=0.1))
    with pytest.warns(UserWarning, match="GradHist2d options adapt are not applied"):
        quantities.GradHist2d(adapt=(None, ParamAbsMax(schedules.linear(2))))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantities.GradHist1d(adapt=NoAdaptation())
    assert not NoAdaptation().should_compute(0) and GradAbsMax(lambda s: True).should_compute(3)


def test_quantities_namespace_time_parameters_and_alpha_type(in_tmp):
    """#22.7: __all__ holds only quantity classes (Cockpit's list, Time included); Alpha is
    the int -1 for a concave fit and for a zero step, as Cockpit's."""
    assert "by_name" not in quantities.__all__ and "Time" in quantities.__all__
    assert all(issubclass(getattr(quantities, n), quantities.Quantity)
               for n in quantities.__all__)
    params_seen = []
    clock, params, alpha = quantities.Time(), quantities.Parameters(), quantities.Alpha()
    cockpit, _ = _train([clock, params, alpha, "Loss"], 3, in_dim=2, out=1,
                        loss_fn=lambda o, y: -o.squeeze(1) ** 2,  # concave along any step
                        each_step=lambda s, c, m, x, y, theta: params_seen.append(theta))
    times = [clock.get_output()[s] for s in range(3)]
    assert all(isinstance(t, float) for t in times) and times == sorted(times)
    for step, theta in enumerate(params_seen):
        for got, want in zip(params.get_output()[step], theta):
            np.testing.assert_array_equal(got, want.numpy())
    cockpit.flush()
    with deepscope.open_run(cockpit.run_path) as run:
        stored = run.quantities("Alpha").set_index("step")
    concave = [s for s in (0, 1) if stored.loc[s, "meta"]["mu"][2] < 0]
    assert 0 in concave  # the batches differ, so a later fit may bend either way
    for s in (0, 1):
        value = alpha.get_output()[s]
        assert (value, type(value)) == ((-1, int) if s in concave
                                        else (pytest.approx(stored.loc[s, "value"]), float))
    still, _ = _train([quantities.Alpha()], 2, make_opt=lambda p: torch.optim.SGD(p, lr=0.0))
    assert type(still.get_output()[0]["Alpha"]) is int


def test_histogram_option_errors(in_tmp):
    with pytest.raises(ValueError, match="bins must be >= 1"):
        quantities.GradHist2d(bins=(0, 5))
    with pytest.raises(ValueError, match="lo < hi"):
        quantities.GradHist1d(range=(1, -1))
    model = extend(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="two GradHist1d quantities with different bins"):
        Cockpit(model.parameters(), quantities=[quantities.GradHist1d(bins=10),
                                                quantities.GradHist1d(bins=20)])
    same = Cockpit(model.parameters(), quantities=[quantities.GradHist1d(bins=10),
                                                   quantities.GradHist1d(bins=10)])
    same.close()
