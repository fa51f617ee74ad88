"""Instrument charts a person can read, checked in the page as drawn (issue 21, item 4):
a few outliers do not set the axis range, log axes tick in powers of ten, quantities of
different scale get their own axis."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import deepscope
from deepscope.instruments.base import QuantityValue

from .conftest import Net, start_server, train_step

pytestmark = pytest.mark.browser
STEPS = 40


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("charts")
    rng = np.random.default_rng(0)
    alpha = rng.normal(0.2, 0.3, STEPS)
    alpha[[7, 21]] = [-1100.0, -300.0]  # the demo's α outliers
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deepscope.Scope(path, run="r", schedule=deepscope.every(10)) as scope:
        scope.watch(model)
        for step in range(STEPS):
            train_step(scope, model, opt, step)
            scope.writer.submit_quantities([
                QuantityValue("Alpha", step, "", float(alpha[step])),
                QuantityValue("GradNorm", step, "", float(10 ** (-3 + 4 * step / STEPS))),
                QuantityValue("MeanGSNR", step, "", 0.02 + 0.001 * step),
                QuantityValue("EarlyStopping", step, "", -2000.0 + 10 * step)])
    address, server = start_server(path)
    yield address
    server.shutdown()
    server.server_close()


def _drawn(page, graph_id: str) -> dict:
    """The chart's traces and its axes as plotly laid them out (ranges, tick labels)."""
    page.wait_for_function(f"(() => {{ const gd = document.querySelector('#{graph_id} "
                           ".js-plotly-plot'); return gd && gd.data && gd.data.length; })()",
                           timeout=20_000)
    return page.evaluate("""(id) => {
        const gd = document.querySelector('#' + id + ' .js-plotly-plot');
        const axes = {};
        for (const [k, a] of Object.entries(gd._fullLayout)) {
            if (k.startsWith('yaxis')) axes[k] = {range: a.range, type: a.type,
                ticks: Array.from(gd.querySelectorAll('.' + a._id + 'tick text'))
                    .map(t => t.textContent)};
        }
        return {data: gd.data.map(t => ({name: t.name, y: t.y, yaxis: t.yaxis})), axes};
    }""", graph_id)


def test_instrument_axes_are_readable(browser, url: str) -> None:
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(url)
    page.click("text=Instruments")
    alpha = _drawn(page, "inst-alpha")
    lo, hi = alpha["axes"]["yaxis"]["range"]
    values = np.array(alpha["data"][0]["y"], dtype=float)
    inside = (values >= lo) & (values <= hi)
    assert inside.mean() >= 0.9
    bulk = values[inside]
    assert hi - lo <= 2 * (bulk.max() - bulk.min())  # the bulk's spread, not the outliers'
    marked = next(t for t in alpha["data"] if t["name"] == "Alpha outside")
    assert len(marked["y"]) == 2

    norm = _drawn(page, "inst-gradnorm")["axes"]["yaxis"]
    assert norm["type"] == "log"
    # one label per decade (10⁻³ ... 10), none of plotly's "5 2 1 5 2" minor digits
    assert len(norm["ticks"]) >= 3 and not {"2", "5"} & set(norm["ticks"])

    snr = _drawn(page, "inst-snr")
    on_axis = {t["name"]: t["yaxis"] for t in snr["data"] if "outside" not in t["name"]}
    assert on_axis["MeanGSNR"] != on_axis["EarlyStopping"]
    for trace in snr["data"]:
        axis = snr["axes"]["yaxis" + (trace["yaxis"] or "y")[1:]]
        lo, hi = axis["range"]
        y = np.array(trace["y"], dtype=float)
        assert (y.max() - y.min()) / (hi - lo) > 0.8  # each quantity fills its own axis
    page.close()
