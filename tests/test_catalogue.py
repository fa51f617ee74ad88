"""The quantity catalogue: a new quantity is one catalogue entry plus its compute function,
and then it is computed, stored, drawn by the GUI's Instruments panels, read by the static
dashboard and exported to TensorBoard with no other edit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deepscope
from deepscope import catalogue
from deepscope.catalogue import QuantitySpec
from deepscope.cli.main import main as cli
from deepscope.dashboard.data import DashboardData
from deepscope.dashboard.figure import plot_dashboard
from deepscope.gui.data import ProjectData
from deepscope.gui.tabs.instruments import layer_options, panels, render_panel
from deepscope.instruments import suite
from deepscope.instruments.quantities import layer_norms
from deepscope.instruments.step import rows
from tests.helpers import train_mlp

SRC = str(Path(deepscope.__file__).parents[1])


@pytest.fixture
def param_norm():
    """ParamNorm ‖θ‖ (per layer and whole model) at the end of the step, added the way a
    contributor adds one: a catalogue entry and a compute function; removed afterwards."""
    catalogue.register(QuantitySpec("ParamNorm", needs=frozenset(), per_layer=True,
                                    panel="gradnorm", dashboard="gradnorm"))

    @suite.computes("ParamNorm")
    def _param_norm(inst, name, state, batch, update):
        with torch.no_grad():
            norms = layer_norms([p.detach() for p in inst._params.values()])
        return rows(name, state.step, inst._names, norms)

    yield "ParamNorm"
    catalogue.unregister("ParamNorm")
    del suite.COMPUTE["ParamNorm"]


def test_a_registered_quantity_reaches_the_run_gui_dashboard_and_export(param_norm, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with deepscope.Scope(tmp_path, "r", schedule=1, instruments=["GradNorm", param_norm],
                         anomalies=False) as scope:
        model = train_mlp(scope, steps=3)
    run = deepscope.open_run(tmp_path / "r")
    stored = run.quantities(param_norm)
    total = stored[stored["layer"] == ""].set_index("step")["value"]
    expected = torch.sqrt(sum(p.detach().double().pow(2).sum() for p in model.parameters()))
    assert total.index.tolist() == [0, 1, 2]
    assert total[2] == pytest.approx(float(expected), rel=1e-6)  # θ after the last step
    layers = set(stored["layer"]) - {""}
    assert layers == {n for n, _ in model.named_parameters()}
    w = dict(model.named_parameters())["l1.weight"]
    assert stored.set_index(["layer", "step"]).loc[("l1.weight", 2), "value"] == pytest.approx(
        float(w.detach().double().norm()), rel=1e-6)

    panel = panels()["gradnorm"]  # the GUI's panel: drawn beside GradNorm
    assert panel.names == ("GradNorm", param_norm)
    rd = ProjectData(tmp_path).run("r")
    figure = render_panel(rd, panel, "l1.weight")
    drawn = {trace["name"]: trace["y"] for trace in figure["data"]}
    assert list(drawn[param_norm]) == pytest.approx(
        stored[stored["layer"] == "l1.weight"]["value"].tolist())
    assert {"label": "l1.weight", "value": "l1.weight"} in layer_options(rd)

    data = DashboardData.load(run)  # the static dashboard: its data and its figure
    assert data.tracked(param_norm)
    assert data.series(param_norm).values.tolist() == total.tolist()
    figure = plot_dashboard(run)
    (axes,) = [ax for ax in figure.axes if ax.get_title().startswith("Gradient norm")]
    legend = [t.get_text().split(":")[0] for t in axes.get_legend().get_texts()]
    assert legend == ["GradNorm", param_norm]

    assert cli(["export", str(tmp_path / "r"), "--tensorboard", str(tmp_path / "tb")]) == 0
    events = EventAccumulator(str(tmp_path / "tb" / "r"))
    events.Reload()
    exported = [(e.step, e.value) for e in events.Scalars(f"quantity/{param_norm}")]
    assert [s for s, _ in exported] == [0, 1, 2]
    assert exported[-1][1] == pytest.approx(total[2], rel=1e-6)


def test_the_catalogue_is_torch_free():
    code = "import sys, deepscope.catalogue; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": SRC})
    assert out.stdout.strip() == "False"


def test_registering_extends_the_names_and_restores(param_norm):
    assert param_norm in catalogue.names() and param_norm not in catalogue.QUANTITY_NAMES
    assert catalogue.resolve_quantities([param_norm, "Loss"]) == ("Loss", param_norm)
    with pytest.raises(ValueError, match="already in the catalogue"):
        catalogue.register(QuantitySpec(param_norm))
    with pytest.raises(ValueError, match="built in"):
        catalogue.unregister("GradNorm")


def test_needing_follows_registering_and_removing():
    """`needing` answers from a cache, which a change of the catalogue empties."""
    assert "EngineNorm" not in catalogue.needing("engine")  # asked (cached) before
    catalogue.register(QuantitySpec("EngineNorm", needs=frozenset({"engine"})))
    try:
        assert "EngineNorm" in catalogue.needing("engine")
    finally:
        catalogue.unregister("EngineNorm")
    assert "EngineNorm" not in catalogue.needing("engine")
    assert "GradNorm" in catalogue.needing("engine")


def test_a_spec_names_only_known_needs_and_panels():
    with pytest.raises(ValueError, match="unknown needs"):
        QuantitySpec("X", needs=frozenset({"gpu"}))
    with pytest.raises(ValueError, match="panel must be one of"):
        QuantitySpec("X", panel="nowhere")


def test_a_quantity_without_compute_function_is_refused(param_norm):
    del suite.COMPUTE[param_norm]
    try:
        with pytest.raises(ValueError, match="ParamNorm has no compute function"):
            suite.Instruments(torch.nn.Linear(2, 1), [param_norm])
    finally:
        suite.COMPUTE[param_norm] = lambda *args: []
