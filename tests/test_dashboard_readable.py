"""`deepscope plot` a person can read (issue 21, item 4), checked on the rendered figure:
no title overlaps a label, no legend covers a point, spikes do not set the value range, and
the title's step is the step the histograms show."""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

import deepscope
from deepscope.dashboard import plot_dashboard
from deepscope.instruments.base import QuantityValue

STEPS = 60
EVERY = 2  # instruments on every 2nd step, KPIs on every step


@pytest.fixture(scope="module")
def fig(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("plot")
    rng = np.random.default_rng(0)
    scope = deepscope.Scope(path, "r", schedule=deepscope.never, anomalies=False)
    values = []
    for step in range(0, STEPS, EVERY):
        tic = -2000.0 if step == 20 else 800.0 if step == 40 else rng.normal(0, 20)
        values += [QuantityValue("TICDiag", step, value=tic),
                   QuantityValue("TICTrace", step, value=0.3 + rng.normal(0, 0.05)),
                   QuantityValue("GradNorm", step, value=float(rng.uniform(0.5, 2.0))),
                   QuantityValue("Distance", step, value=step / 10),
                   QuantityValue("UpdateSize", step, value=0.02 + rng.normal(0, 0.002)),
                   QuantityValue("Alpha", step, value=float(rng.normal(0, 0.5))),
                   QuantityValue("GradHist1d", step, array=np.arange(20) + step,
                                 meta={"edges": [-1.0, 1.0, 20], "underflow": 0,
                                       "overflow": 0, "nan": 0, "posinf": 0, "neginf": 0})]
    scope.writer.submit_quantities(values)
    scope.writer.submit_kpis([(name, step, "default", value) for step in range(STEPS)
                              for name, value in (("loss", 2.0 / (step + 1)),
                                                  ("accuracy", step / STEPS))])
    scope.close()
    figure = plot_dashboard(scope.run_dir)
    FigureCanvasAgg(figure).draw()
    return figure


def _panels(fig) -> dict:
    return {ax.get_label()[6:]: ax for ax in fig.axes if ax.get_label().startswith("panel:")}


def test_titles_and_axis_labels_do_not_overlap(fig) -> None:
    renderer = fig.canvas.get_renderer()
    texts = [t for ax in fig.axes if not ax.get_label().startswith("group:")
             for t in (ax.title, ax.xaxis.label) if t.get_text()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    clashes = [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
               if box_a.overlaps(box_b)]
    assert clashes == []


def test_legends_cover_no_point(fig) -> None:
    renderer = fig.canvas.get_renderer()
    checked = 0
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None or ax.get_label() == "panel:alpha":
            continue
        box = legend.get_window_extent(renderer)
        for other in [a for a in fig.axes if a.bbox.bounds == ax.bbox.bounds]:  # with twins
            for line in other.get_lines():
                xy = other.transData.transform(np.column_stack(line.get_data()).astype(float))
                xy = xy[np.isfinite(xy).all(1)]
                inside = ((xy[:, 0] > box.x0) & (xy[:, 0] < box.x1)
                          & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1))
                assert not inside.any(), (ax.get_label(), line.get_label())
                checked += 1
    assert checked >= 6


def test_spikes_do_not_set_the_range_and_are_marked(fig) -> None:
    tic = _panels(fig)["tic"]
    lo, hi = tic.get_ylim()
    diag = next(line for line in tic.get_lines() if line.get_label().startswith("TICDiag"))
    y = np.asarray(diag.get_ydata(), dtype=float)
    assert np.mean((y >= lo) & (y <= hi)) >= 0.9
    assert hi - lo < 500  # the bulk (±60), not the spikes' 2800
    edges = [line for line in tic.get_lines() if line.get_marker() in ("^", "v")]
    assert sorted(int(x) for line in edges for x in line.get_xdata()) == [20, 40]


def test_title_step_is_the_histogram_step(fig) -> None:
    last_instrument = STEPS - EVERY
    assert f"instruments at step {last_instrument}, KPIs to step {STEPS - 1}" in \
        fig.get_suptitle()
    assert f"(step {last_instrument})" in _panels(fig)["hist1d"].get_title()
