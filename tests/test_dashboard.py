"""The static instrument dashboard (`plot_dashboard`, `deepscope plot`) on synthetic runs."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.image
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.patches import StepPatch

import deepscope
from deepscope.cli.main import main
from deepscope.dashboard import plot_dashboard
from deepscope.dashboard.figure import PANELS
from deepscope.instruments.base import QuantityValue

SCALARS = ("Loss", "Distance", "UpdateSize", "NormTest", "InnerTest", "OrthoTest", "HessMaxEV",
           "HessTrace", "TICDiag", "TICTrace", "Alpha")
EDGES_2D = [[-1.0, 1.0, 40], [-2.0, 2.0, 50]]
GRADNORM_MISSING_AT = 3


def _hist_meta(edges, **counts) -> dict:
    return {"edges": edges, "underflow": 0, "overflow": 0, "nan": 0, "posinf": 0, "neginf": 0,
            **counts}


def _write_run(path, steps: int = 8, names=SCALARS + ("GradNorm", "GradHist1d", "GradHist2d"),
               kpis: bool = True) -> str:
    """A run holding synthetic values of `names` (GradNorm missing at one step, with a reason)
    and, with kpis, loss / accuracy / learning_rate KPIs. Returns the run folder."""
    scope = deepscope.Scope(path, "synthetic", schedule=deepscope.never, anomalies=False)
    rng = np.random.default_rng(0)
    values: list[QuantityValue] = []
    for step in range(steps):
        for name in names:
            if name == "GradHist1d":
                values.append(QuantityValue(name, step, array=np.arange(100) + step,
                                            meta=_hist_meta([-2.0, 2.0, 100], nan=2, overflow=5)))
            elif name == "GradHist2d":
                values.append(QuantityValue(name, step, array=rng.integers(0, 50, (40, 50)),
                                            meta=_hist_meta(EDGES_2D)))
            elif name == "GradNorm" and step == GRADNORM_MISSING_AT:
                values.append(QuantityValue(name, step, meta={"reason": "synthetic failure"}))
            else:
                values.append(QuantityValue(name, step, value=1.0 + step / 10 + len(name) / 100,
                                            meta={"tau": 0.1, "mu": [1.0, -1.0, 2.0]}))
        values += [QuantityValue("HessTrace", step, layer, value=float(step))
                   for layer in ("0.weight", "0.bias") if "HessTrace" in names]
    scope.writer.submit_quantities(values)
    if kpis:
        scope.writer.submit_kpis([(name, step, "default", value) for step in range(steps)
                                  for name, value in (("loss", 2.0 / (step + 1)),
                                                      ("accuracy", step / steps),
                                                      ("learning_rate", 0.1))])
    scope.close()
    return str(scope.run_dir)


def _panel(fig: Figure, key: str) -> Axes:
    found = [ax for ax in fig.axes if ax.get_label() == f"panel:{key}"]
    assert len(found) == 1, f"panel {key}: {len(found)} axes"
    return found[0]


def _texts(fig: Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def _line(ax: Axes, name: str):
    return next(line for line in ax.get_lines() if line.get_label().startswith(name))


def _axes_of(fig: Figure, name: str) -> Axes:
    """The axes holding the line of series `name`."""
    return next(ax for ax in fig.axes
                if any(line.get_label().startswith(name) for line in ax.get_lines()))


def test_every_panel_draws_from_synthetic_quantities(tmp_path):
    fig = plot_dashboard(_write_run(tmp_path))
    texts = _texts(fig)
    assert not any("not tracked" in t or "cannot draw" in t or "no value" in t for t in texts)
    for key in PANELS:
        _panel(fig, key)
    assert {ax.get_label() for ax in fig.axes} >= {"group:STEP SIZE", "group:GRADIENTS",
                                                   "group:CURVATURE"}
    # series: the stored values, NaN (a gap) at the missing step, marked with a red cross
    gradnorm = _line(_panel(fig, "gradnorm"), "GradNorm")
    expected = [np.nan if s == GRADNORM_MISSING_AT else 1.0 + s / 10 + 0.08 for s in range(8)]
    np.testing.assert_allclose(gradnorm.get_ydata(), expected)
    assert "(1 missing)" in gradnorm.get_label()
    crosses = [line for line in _panel(fig, "gradnorm").get_lines() if line.get_marker() == "x"]
    assert [list(c.get_xdata()) for c in crosses] == [[GRADNORM_MISSING_AT]]
    # the two-axis panel: Distance left, UpdateSize on the twin
    distance, update = _panel(fig, "distance"), _axes_of(fig, "UpdateSize")
    assert _axes_of(fig, "Distance") is distance and update is not distance
    assert update.get_shared_x_axes().joined(update, distance)
    assert "HessTrace" in _line(_panel(fig, "hesstrace"), "HessTrace").get_label()
    assert len(_panel(fig, "hesstrace").get_lines()) == 3  # total + two faint layers
    # histograms: the latest step's counts, extras listed
    hist1d = _panel(fig, "hist1d")
    [stairs] = [p for p in hist1d.patches if isinstance(p, StepPatch)]
    np.testing.assert_array_equal(stairs.get_data().values, np.arange(100) + 7)
    assert "step 7" in hist1d.get_title()
    assert any("NaN 2" in t and "above range 5" in t for t in texts)
    assert any(isinstance(a, AxesImage) for a in _panel(fig, "hist2d").get_children())
    # α: the unit parabola and the last step on it
    alpha = _panel(fig, "alpha")
    assert any("last step: α = 1.75" in line.get_label() for line in alpha.get_lines())
    # gauge, hyperparameters, performance
    assert len(_panel(fig, "tests").patches) == 3  # norm disc, inner band, ortho band
    assert _line(_panel(fig, "hyperparameters"), "learning_rate").get_label().endswith("0.1")
    assert _line(_panel(fig, "performance"), "loss")
    # the title names the step the instrument panels and the histograms show
    assert "synthetic (instruments at step 7)" in fig.get_suptitle()


def test_only_tracked_panels_are_drawn(tmp_path):
    fig = plot_dashboard(_write_run(tmp_path, names=("Loss", "GradNorm"), kpis=False))
    drawn = {ax.get_label() for ax in fig.axes}
    for key in ("alpha", "distance", "tests", "hist1d", "hist2d", "hessmaxev", "hesstrace",
                "tic"):
        assert f"panel:{key}" not in drawn, key
    groups = {ax.get_label(): [t.get_text() for t in ax.texts] for ax in fig.axes
              if ax.get_label().startswith("group:")}
    assert groups["group:CURVATURE"] == ["not tracked in this run:\n"
                                         "HessMaxEV, HessTrace, TICDiag, TICTrace"]
    assert groups["group:STEP SIZE"] == []  # GradNorm is drawn there
    texts = [t.get_text() for t in _panel(fig, "hyperparameters").texts]
    assert any(t.startswith("not tracked") and "optimizer=" in t for t in texts)
    assert not _panel(fig, "gradnorm").texts
    assert _line(_panel(fig, "performance"), "Loss")  # the quantity, as no loss KPI exists


def test_declared_instruments_without_values_yet(tmp_path):
    scope = deepscope.Scope(tmp_path, "fresh", instruments="economy", anomalies=False)
    scope.watch(torch.nn.Linear(3, 2))
    scope.close()
    fig = plot_dashboard(scope.run_dir)
    assert [t.get_text() for t in _panel(fig, "alpha").texts] == ["tracked, no value yet"]
    assert "panel:hessmaxev" not in {ax.get_label() for ax in fig.axes}  # economy
    assert "no values yet" in fig.get_suptitle()


def test_one_step_and_non_finite_values_draw(tmp_path):
    scope = deepscope.Scope(tmp_path, "odd", schedule=deepscope.never, anomalies=False)
    scope.writer.submit_quantities([
        QuantityValue("GradNorm", 0, value=math.nan),
        QuantityValue("Alpha", 0, value=math.inf),
        QuantityValue("NormTest", 0, value=0.5),
        QuantityValue("GradHist1d", 0, meta={"reason": "no per-sample gradients"}),
    ])
    scope.close()
    fig = plot_dashboard(scope.run_dir)
    fig.canvas.draw()  # rendering must not fail either
    assert any(t.get_text().startswith("no finite value") for t in _panel(fig, "gradnorm").texts)
    assert any(t.get_text().startswith("no finite α") for t in _panel(fig, "alpha").texts)
    assert _line(_axes_of(fig, "NormTest"), "NormTest").get_marker() == "o"
    assert [t.get_text() for t in _panel(fig, "hist1d").texts] == ["tracked, no value yet"]


def test_redraw_into_the_same_figure_and_step_limit(tmp_path):
    run_dir = _write_run(tmp_path)
    fig = plot_dashboard(run_dir, step=3)
    assert "step 3" in _panel(fig, "hist1d").get_title()
    assert len(_line(_panel(fig, "gradnorm"), "GradNorm").get_xdata()) == 4
    n_axes = len(fig.axes)
    with deepscope.open_run(run_dir) as run:
        again = plot_dashboard(run, fig=fig)
    assert again is fig and len(fig.axes) == n_axes  # cleared, not stacked
    assert len(_line(_panel(fig, "gradnorm"), "GradNorm").get_xdata()) == 8


def test_a_failing_panel_spares_the_others(tmp_path, monkeypatch):
    def broken(*_):
        raise RuntimeError("boom")

    monkeypatch.setitem(PANELS, "gradnorm", broken)
    fig = plot_dashboard(_write_run(tmp_path))
    assert any("cannot draw gradnorm: RuntimeError: boom" in t for t in _texts(fig))
    _panel(fig, "alpha")


def test_cli_writes_a_png(tmp_path, capsys):
    out = tmp_path / "cockpit.png"
    assert main(["plot", _write_run(tmp_path), "-o", str(out)]) == 0
    assert out.exists() and out.stat().st_size > 10_000
    assert matplotlib.image.imread(out).shape[:2] == (1100, 1800)
    assert "1800 x 1100" in capsys.readouterr().out
    small = tmp_path / "small.png"
    assert main(["plot", str(tmp_path / "synthetic"), "-o", str(small), "--dpi", "40"]) == 0
    assert matplotlib.image.imread(small).shape[:2] == (440, 720)


def test_cli_bad_path_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("deepscope: error: no deepscope run at")
    _write_run(tmp_path)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a project folder; pass one of its runs" in err
    assert not (tmp_path / "x.png").exists()


def test_values_stored_with_a_note_are_drawn_as_rings(tmp_path):
    # a HessMaxEV that did not converge is a lower bound, not a value like the others
    scope = deepscope.Scope(tmp_path, "ev", schedule=deepscope.never, anomalies=False)
    scope.writer.submit_quantities([
        QuantityValue("HessMaxEV", 4 * step, value=3.0 + step,
                      meta={"every": 4, **({"note": "Lanczos did not converge"}
                                            if step in (1, 3) else {})})
        for step in range(5)])
    scope.close()
    fig = plot_dashboard(scope.run_dir)
    ax = _axes_of(fig, "HessMaxEV")
    label = _line(ax, "HessMaxEV").get_label()
    assert "(2 noted: rings)" in label and "(every 4 instrumented steps)" in label
    rings = [line for line in ax.get_lines() if line.get_markerfacecolor() == "white"]
    assert len(rings) == 1 and list(rings[0].get_xdata()) == [4, 12]
