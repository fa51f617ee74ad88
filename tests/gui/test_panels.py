"""Panels, instruments and figures computed from recorded runs (no browser)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import deepscope
from deepscope.gui import graph_view, panels
from deepscope.gui.data import ProjectData
from deepscope.gui.figures import decimate, ema
from deepscope.gui.selection import Request, resolve
from deepscope.gui.tabs import instruments
from deepscope.gui.tabs.graph import node_colouring
from deepscope.gui.tabs.instruments import PANELS, layer_options, render_panel, section_warnings
from deepscope.instruments.base import QuantityValue

from .conftest import STEPS, WARNING, record_run


@pytest.fixture(scope="module")
def data(project: Path) -> ProjectData:
    return ProjectData(project)


def _sel(data: ProjectData, **req: object) -> dict:
    return resolve(data, Request(**req), None)[0].as_dict()


def test_a_quantity_the_run_did_not_record_says_not_tracked(data: ProjectData) -> None:
    fig = render_panel(data.run("other"), PANELS["gradnorm"], "")
    assert fig["data"] == []
    assert "GradNorm: not tracked" in fig["layout"]["annotations"][0]["text"]
    fig = render_panel(data.run("base"), PANELS["tic"], "")
    assert "not tracked" in fig["layout"]["annotations"][0]["text"]


def test_instrument_panels_draw_what_was_recorded(data: ProjectData) -> None:
    base = data.run("base")
    tests = render_panel(base, PANELS["tests"], "")
    assert [t["name"] for t in tests["data"]] == ["NormTest", "InnerTest", "OrthoTest"]
    alpha = render_panel(base, PANELS["alpha"], "")["data"][0]
    assert alpha["y"][0] is None and alpha["y"][1] == 0.25   # missing at step 0: a gap
    # per layer where recorded; whole-model quantities say they fell back
    layered = render_panel(base, PANELS["gradnorm"], "pre.weight")
    total = render_panel(base, PANELS["gradnorm"], "")
    assert layered["data"][0]["y"] != total["data"][0]["y"]
    assert "whole model" in render_panel(base, PANELS["tests"], "pre.weight")["layout"][
        "title"]["text"]
    assert [o["value"] for o in layer_options(base)] == ["", "out.bias", "out.weight",
                                                          "pre.bias", "pre.weight"]
    perf = render_panel(base, PANELS["performance"], "")
    assert [t["name"] for t in perf["data"]] == ["kpi: loss"]
    assert "not tracked: Loss" in perf["layout"]["annotations"][0]["text"]


def test_gradient_histograms_with_changing_ranges_share_one_grid(tmp_path: Path) -> None:
    scope = deepscope.Scope(tmp_path, run="h", schedule=deepscope.every(1))
    for step, (lo, hi) in enumerate([(-1.0, 1.0), (-2.0, 2.0)]):
        with scope.step(step) as rec:
            rec.tensor("x", torch.ones(2, 2), role="input")
        scope.writer.submit_quantities([QuantityValue(
            "GradHist1d", step, "", None, np.array([1, 2, 3, 4], dtype=np.int64),
            {"edges": [lo, hi, 4], "underflow": 1, "overflow": 0, "nan": 2, "posinf": 0,
             "neginf": 0})])
    scope.close()
    fig = render_panel(ProjectData(tmp_path).run("h"), PANELS["hist1d"], "")
    heat = fig["data"][0]
    counts = np.power(10.0, np.array(heat["z"])) - 1
    assert heat["x"] == [0, 1] and counts.sum(axis=0) == pytest.approx([10, 10])
    # the union of the ranges at the finest recorded bin width
    assert heat["y"] == pytest.approx([-1.75 + 0.5 * i for i in range(8)])
    assert "6 outside the range or non-finite" in fig["layout"]["annotations"][0]["text"]


def test_history_has_one_point_per_recorded_step_and_names_absent_runs(
        data: ProjectData) -> None:
    sel = _sel(data)
    fig = panels.history(data, ["base", "other", "recurrent"], sel, "norm")
    assert [t["x"] for t in fig["data"]] == [list(range(STEPS))] * 2
    assert "not recorded in recurrent" in fig["layout"]["annotations"][0]["text"]
    assert fig["layout"]["shapes"][0]["x0"] == STEPS - 1


def test_values_fall_back_and_parameters_have_no_batch_items(data: ProjectData) -> None:
    base = data.run("base")
    sel = _sel(data, node="pre", tensor="pre.weight")
    fig = panels.values_panel(base, sel)
    assert fig["layout"]["meta"]["view"] == "neuron_mean" and len(fig["data"][0]["y"]) == 8
    assert "no batch dimension" in panels.items_panel(base, sel)["layout"]["annotations"][0][
        "text"]
    loss = _sel(data, node="loss", tensor="loss")
    assert "scalar" in panels.values_panel(base, loss)["layout"]["annotations"][0]["text"]
    sample = _sel(data, batch="sample:1")
    fig = panels.values_panel(base, sample)
    assert fig["layout"]["meta"]["view"] == "samples" and len(fig["data"][0]["y"]) == 3


def test_non_finite_values_are_flagged_in_table_and_graph(tmp_path: Path) -> None:
    with deepscope.Scope(tmp_path, run="bad", schedule=deepscope.every(1)) as scope:
        with scope.step(0) as rec:
            x = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
            rec.tensor("x", x, role="input")
            rec.tensor("y", x * 2, role="output")
    project = ProjectData(tmp_path)
    sel = _sel(project)
    banner, _ = panels.stats_table(project.run("bad"), sel)
    assert "1 nan in forward" in str(banner) and "1 posinf" in str(banner)
    rd = project.run("bad")
    layout = graph_view.build_layout(rd.graph(0, 0))
    _colours, _scale, flags, _caption = node_colouring(rd, sel, layout, "role")
    assert set(flags) == {"x", "y"}
    labels = {e["data"]["id"]: e["data"]["label"]
              for e in graph_view.elements(layout, None, None, flags=flags) if "label" in
              e["data"]}
    assert labels["x"].startswith("⚠")


def test_colour_by_quantity_maps_layers_to_nodes(data: ProjectData) -> None:
    rd = data.run("base")
    sel = _sel(data)
    layout = graph_view.build_layout(rd.graph(sel["step"], 0))
    colours, scale, _flags, caption = node_colouring(rd, sel, layout, "q:GradNorm")
    assert scale is not None and caption.startswith(f"GradNorm at step {STEPS - 1}")
    assert colours["pre"] != graph_view.MISSING_COLOUR
    assert colours["input"] == graph_view.MISSING_COLOUR   # no parameter, no value
    _c, _s, _f, caption = node_colouring(data.run("other"), _sel(data, run="other"), layout,
                                     "q:GradNorm")
    assert "not tracked" in caption


def test_decimation_keeps_spikes_and_gaps() -> None:
    x = np.arange(10_000)
    y = np.sin(x / 100.0)
    y[5_000], y[7_000] = 50.0, np.nan
    sx, sy = decimate(x, y)
    assert len(sx) <= 2_000 and 5_000 in sx and 7_000 in sx
    assert np.all(np.diff(sx) > 0)
    assert decimate(x[:100], y[:100])[0].tolist() == list(range(100))


def test_ema_smooths_with_debiasing_and_skips_gaps() -> None:
    out = ema([1.0, float("nan"), 3.0], 0.5)
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == pytest.approx(1 / 3 + 2)


def test_warnings_are_listed_in_the_sections_of_the_quantities_they_affect(
        data: ProjectData) -> None:
    head = f"⚠ step 1 · BatchNorm1d 'bn': {WARNING.message}"
    # GradNorm is drawn under "Step size", the gradient tests under "Gradients"
    assert section_warnings(data.run("base")) == [[f"{head} (affects GradNorm)"],
                                                  [f"{head} (affects NormTest, InnerTest)"],
                                                  [], []]
    assert section_warnings(data.run("other")) == [[], [], [], []]


def test_the_instruments_answer_is_built_once_per_run_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Switching back and forth between runs builds no figure again while the files are
    unchanged; a commit (new size or time) rebuilds it; an answer holding a failed panel is
    not kept, so the next switch tries again."""
    record_run(tmp_path, "base")
    built: list[str] = []
    fail = {"GradNorm"}
    plain = instruments.render_panel

    def counted(rd: object, panel: instruments.Panel, layer: str) -> object:
        built.append(panel.title)
        if fail & set(panel.names):
            raise RuntimeError("simulated failure")
        return plain(rd, panel, layer)
    monkeypatch.setattr(instruments, "render_panel", counted)
    rd = ProjectData(tmp_path).run("base")
    first, _ = instruments.cached_dashboard(rd, "")
    assert "simulated failure" in first["inst-gradnorm"]["layout"]["annotations"][0]["text"]
    instruments.cached_dashboard(rd, "")            # a failed answer is built again
    assert len(built) == 2 * len(PANELS)
    fail.clear()
    kept, warnings = instruments.cached_dashboard(rd, "")
    assert instruments.cached_dashboard(rd, "") == (kept, warnings)
    assert len(built) == 3 * len(PANELS)            # kept: the fourth call built nothing
    assert kept["inst-gradnorm"]["data"][0]["name"] == "GradNorm"
    instruments.cached_dashboard(rd, "pre.weight")  # another layer is another answer
    assert len(built) == 4 * len(PANELS)
    store = tmp_path / "base" / "rank0.sqlite"
    stat = store.stat()
    os.utime(store, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as a commit does
    instruments.cached_dashboard(rd, "")
    assert len(built) == 5 * len(PANELS)


def test_values_stored_with_a_note_are_rings_with_the_note_in_their_hover(tmp_path: Path) -> None:
    # HessMaxEV whose Lanczos did not converge is a lower bound: it must not look like the
    # converged values beside it
    lower = "Lanczos did not converge within lanczos_iter=10 iterations: a lower bound"
    scope = deepscope.Scope(tmp_path, run="ev", schedule=deepscope.never)
    scope.writer.submit_quantities([
        QuantityValue("HessMaxEV", 4 * step, "", value, None,
                      {"converged": step != 2, "every": 4,
                       **({"note": lower} if step == 2 else {})})
        for step, value in enumerate([3.0, 3.5, 3.2, 3.9])])
    scope.close()
    fig = render_panel(ProjectData(tmp_path).run("ev"), PANELS["hessmaxev"], "")
    trace = fig["data"][0]
    assert trace["marker"]["symbol"] == ["circle", "circle", "circle-open", "circle"]
    assert "did not converge" in trace["customdata"][2] and trace["customdata"][0] == ""
    assert "%{customdata}" in trace["hovertemplate"]
    remark = fig["layout"]["annotations"][0]["text"]
    # sparse points, not gaps; a lower bound, not a value like the others
    assert "HessMaxEV: every 4th instrumented step, 1 of 4 values noted" in remark
    # without notes the trace is as before
    scope = deepscope.Scope(tmp_path, run="plain", schedule=deepscope.never)
    scope.writer.submit_quantities([QuantityValue("HessMaxEV", 0, "", 3.0, None, {})])
    scope.close()
    trace = render_panel(ProjectData(tmp_path).run("plain"), PANELS["hessmaxev"], "")["data"][0]
    assert "symbol" not in trace["marker"] and "customdata" not in trace
