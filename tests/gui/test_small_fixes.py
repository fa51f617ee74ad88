"""Small GUI fixes of issue 21, item 9, checked on the data the callbacks return."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepscope
from deepscope.gui import panels
from deepscope.gui.data import ProjectData
from deepscope.gui.figures import share_scale, values_figure
from deepscope.gui.selection import Request, resolve
from deepscope.store.schema import STAT_COLUMNS


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> ProjectData:
    path = tmp_path_factory.mktemp("small")
    with deepscope.Scope(path, "r", schedule=1, max_samples=2) as scope:
        for step, kind in enumerate(["len_06", "len_01", "len_04"]):
            with scope.step(step, kind=kind) as rec:
                x = torch.arange(12.0).reshape(3, 4) * (step + 1) - 5
                rec.tensor("x", x, role="input")
                rec.tensor("total", x.sum(), role="output")
    return ProjectData(path)


def _resolve(data: ProjectData, **req: object):
    return resolve(data, Request(**req), None)


def test_kinds_are_offered_sorted(data: ProjectData) -> None:
    _sel, choices = _resolve(data)
    assert [k["value"] for k in choices.kinds] == ["len_01", "len_04", "len_06"]


def test_a_scalar_offers_no_rows_or_items(data: ProjectData) -> None:
    sel, choices = _resolve(data, node="total", tensor="total")
    assert sel.tensor == "total"
    assert [b["label"] for b in choices.batches] == ["the value (a scalar)"]


def test_stats_table_of_a_batch_item_is_that_items_statistics(data: ProjectData) -> None:
    sel, _ = _resolve(data, kind="len_04", node="x", tensor="x", batch="sample:1")
    sel = sel.as_dict()
    _banner, table = panels.stats_table(data.run("r"), sel)
    header = [th.children for th in table.children[1].children.children]
    assert header == ["statistic", "forward", "batch item 1"]
    cells = {tr.children[0].children: [td.children for td in tr.children[1:]]
             for tr in table.children[2].children}
    item = np.arange(4.0, 8.0) * 3 - 5  # step 2 (len_04), row 1
    assert cells["numel"] == ["12", "4"]
    assert float(cells["mean"][1]) == pytest.approx(item.mean())
    assert float(cells["max"][1]) == pytest.approx(item.max())
    assert float(cells["std"][1]) == pytest.approx(item.std(), rel=1e-4)
    assert set(cells) == set(STAT_COLUMNS)
    whole = dict(sel, batch="mean")
    header = [th.children for th in panels.stats_table(data.run("r"), whole)[1]
              .children[1].children.children]
    assert header == ["statistic", "forward"]


def test_compare_columns_share_one_value_scale() -> None:
    a = values_figure(np.array([0.5, 1.0, 2.0]), "a")
    b = values_figure(np.array([-4.0, 1.0]), "b")
    share_scale(a, b)
    lo, hi = a["layout"]["yaxis"]["range"]
    assert lo < -4.0 and 2.0 < hi < 2.5
    heat_a = values_figure(np.array([[1.0, -2.0]]), "a")
    share_scale(heat_a, values_figure(np.array([[3.0, 0.0]]), "b"))
    assert (heat_a["data"][0]["zmin"], heat_a["data"][0]["zmax"]) == (-3.0, 3.0)


def test_the_mode_bar_stays_off_the_titles() -> None:
    layout = values_figure(np.zeros(3), "a long title")["layout"]
    assert layout["modebar"]["orientation"] == "v" and layout["margin"]["r"] >= 30


def test_reading_a_finished_run_leaves_its_version(tmp_path) -> None:
    """The first read of a finished run creates an empty WAL file: not new data (the page
    would redraw every tab once, seconds after it loaded)."""
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope, scope.step(0) as rec:
        rec.tensor("x", torch.ones(2, 3), role="input")
    rd = ProjectData(tmp_path).run("r")
    before = rd.version()
    assert rd.step_index()  # opens the run's file
    assert (tmp_path / "r" / "rank0.sqlite-wal").exists()
    assert rd.version() == before


def test_long_lines_are_drawn_without_point_markers() -> None:
    """A marker per point of a 75-step line crowds the panel and made plotly draw the
    Instruments dashboard 2-4x slower; short lines keep them."""
    from deepscope.gui.figures import line_trace

    assert line_trace("long", range(75), range(75))["mode"] == "lines"
    assert line_trace("short", range(20), range(20))["mode"] == "lines+markers"
