"""Readable value axes (issue 21, item 4): the range fits the bulk of the points, outliers are
marked at its edge, log axes tick once per decade, quantities of different scale get their
own axis."""

from __future__ import annotations

import numpy as np
import pytest

from deepscope.gui.axes import robust_range, series_figure
from deepscope.gui.figures import line_trace


def _inside(values: np.ndarray, bounds: tuple[float, float]) -> float:
    return float(np.mean((values >= bounds[0]) & (values <= bounds[1])))


def test_a_few_outliers_do_not_set_the_range_and_are_marked() -> None:
    rng = np.random.default_rng(0)
    alpha = rng.normal(0.3, 0.2, 100)
    alpha[[10, 50, 90]] = [-1100.0, -400.0, -250.0]  # what flattened the demo's α panel
    fig = series_figure("Alpha", [line_trace("Alpha", np.arange(100), alpha)])
    lo, hi = fig["layout"]["yaxis"]["range"]
    assert _inside(alpha, (lo, hi)) >= 0.9
    bulk = np.delete(alpha, [10, 50, 90])
    assert hi - lo < 3 * (bulk.max() - bulk.min())  # the range is the bulk's, not 1100 wide
    marks = [t for t in fig["data"] if t["name"].endswith("outside")]
    assert len(marks) == 1 and sorted(marks[0]["x"]) == [10, 50, 90]
    assert marks[0]["y"] == [lo] * 3 and "-1100" in " ".join(marks[0]["text"])
    assert "3 points outside the range" in fig["layout"]["annotations"][0]["text"]


def test_without_outliers_every_point_is_inside() -> None:
    v = np.linspace(-2.0, 5.0, 40)
    fig = series_figure("x", [line_trace("x", np.arange(40), v)])
    lo, hi = fig["layout"]["yaxis"]["range"]
    assert lo < -2.0 and hi > 5.0 and "annotations" not in fig["layout"]
    assert len(fig["data"]) == 1


def test_log_axis_ticks_once_per_decade_in_powers_of_ten() -> None:
    norm = np.geomspace(1e-3, 10.0, 50)
    axis = series_figure("GradNorm", [line_trace("GradNorm", np.arange(50), norm)])[
        "layout"]["yaxis"]
    assert axis["type"] == "log" and axis["dtick"] == 1 and axis["exponentformat"] == "power"
    lo, hi = axis["range"]  # log10 units
    assert lo < -3 and hi > 1


def test_quantities_of_different_scale_get_one_axis_each() -> None:
    steps = np.arange(30)
    gsnr = line_trace("MeanGSNR", steps, np.full(30, 0.02) + np.linspace(0, 0.01, 30))
    cabs = line_trace("CABS", steps, np.full(30, 60.0) + np.linspace(0, 5, 30), 1)
    stop = line_trace("EarlyStopping", steps, np.linspace(-3000, -1000, 30), 2)
    fig = series_figure("GSNR", [gsnr, cabs, stop])
    layout = fig["layout"]
    assert [t["yaxis"] for t in fig["data"]] == ["y", "y2", "y3"]
    domains = [layout[k]["domain"] for k in ("yaxis", "yaxis2", "yaxis3")]
    assert all(a[0] >= b[1] for a, b in zip(domains, domains[1:]))  # stacked, no overlap
    for key, trace in zip(("yaxis", "yaxis2", "yaxis3"), fig["data"]):
        lo, hi = layout[key]["range"]
        y = np.asarray(trace["y"])
        assert lo <= y.min() and y.max() <= hi
        assert (y.max() - y.min()) / (hi - lo) > 0.8  # each fills its own axis
    same = series_figure("tests", [line_trace("a", steps, np.full(30, 0.5)),
                                   line_trace("b", steps, np.full(30, 0.2), 1)])
    assert "yaxis2" not in same["layout"]


@pytest.mark.parametrize("values", [[], [None, None], [float("nan")]])
def test_no_finite_value_leaves_the_range_to_plotly(values) -> None:
    assert robust_range(values) is None


def test_each_row_chooses_its_own_scale_type() -> None:
    steps = np.arange(40)
    cabs = line_trace("CABS", steps, np.geomspace(1e-4, 1e-1, 40))
    stop = line_trace("EarlyStopping", steps, np.linspace(-3.0, 1.0, 40), 1)
    layout = series_figure("snr", [cabs, stop])["layout"]
    assert layout["yaxis"]["type"] == "log" and "type" not in layout["yaxis2"]


def test_heavy_tails_still_leave_nine_in_ten_points_inside() -> None:
    rng = np.random.default_rng(1)
    tic = rng.standard_t(1, 75) * 10  # Cauchy-like: the demo's TICDiag
    lo, hi = robust_range(tic)
    assert _inside(tic, (lo, hi)) >= 0.9


def test_a_right_axis_has_its_own_ticks_and_room_beside_the_mode_bar() -> None:
    steps = np.arange(20)
    fig = series_figure("d", [line_trace("Distance", steps, np.linspace(0, 8, 20))],
                        [line_trace("UpdateSize", steps, np.linspace(0.01, 0.06, 20), 1)])
    layout = fig["layout"]
    assert layout["yaxis2"]["tickmode"] == "auto" and layout["yaxis2"]["overlaying"] == "y"
    assert layout["margin"]["r"] >= 80 and fig["data"][1]["yaxis"] == "y2"
