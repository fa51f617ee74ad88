"""The GUI on distributed runs, in headless Chromium (issue 15, item 6): the rank selector
switches the statistics and KPI charts between the global batch, one rank and all ranks;
the Instruments tab's spread strip shows each rank's local values; a rank whose graph
differs from rank 0's and a missing rank are named; a single-process run shows none of it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import deepscope

from .conftest import record_run, start_server
from .ranks_runs import STEPS, local_loss, local_norm, record_ranks
from .test_browser import IMG, figure, open_graph, pick, wait_figure

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """ddp: 2 ranks; odd-ranks: 4 ranks of which rank 3 is missing and rank 2 has a bad
    shard and another graph; single: one process."""
    path = tmp_path_factory.mktemp("ranks")
    record_ranks(path, "ddp")
    record_ranks(path, "odd-ranks", world=4, present=(0, 1, 2), bad=2, other_graph=2)
    record_run(path, "single", instruments=False)
    url, server = start_server(path)
    yield path, url
    server.shutdown()
    server.server_close()


def norms(path: Path, rank: int) -> np.ndarray:
    """The output's forward norm per step as rank `rank` recorded it."""
    with deepscope.open_run(path / "ddp") as run:
        return run.stats_wide("output", direction="forward", rank=rank)["norm"].to_numpy()


def history(page, names: list[str]) -> dict:
    """The over-steps chart once it shows exactly the traces `names`."""
    return wait_figure(page, "over-steps", "JSON.stringify(gd.data.map(t => t.name)) === "
                       + json.dumps(json.dumps(names, separators=(",", ":"), ensure_ascii=False)))


def test_rank_selector_strip_and_graph_warning(browser, project: tuple[Path, str]) -> None:
    path, url = project
    context, page = open_graph(browser, url)
    try:
        page.wait_for_selector("#rank-ctl", state="visible", timeout=20_000)
        assert page.inner_text("#rank-status") == "2 ranks"
        # global: the statistics of the global batch, merged from both ranks: the norm over
        # the concatenated batch is the root of the ranks' squared norms
        merged = history(page, ["ddp"])
        assert "global batch" in merged["layout"]["title"]["text"]
        np.testing.assert_allclose(merged["data"][0]["y"],
                                   np.hypot(norms(path, 0), norms(path, 1)), rtol=1e-6)
        assert "global batch" in page.inner_text("#stats-table caption")
        pick(page, "rank-choice", "rank 1")
        one = history(page, ["ddp · rank 1"])
        np.testing.assert_allclose(one["data"][0]["y"], norms(path, 1), rtol=1e-6)
        page.wait_for_function("document.querySelector('#stats-table caption').innerText"
                               ".endsWith('rank 1')", timeout=20_000)
        pick(page, "rank-choice", "all ranks")
        both = history(page, ["ddp · rank 0", "ddp · rank 1"])
        for rank in (0, 1):
            np.testing.assert_allclose(both["data"][rank]["y"], norms(path, rank), rtol=1e-6)
        # the statistics table: one column per rank
        page.wait_for_function("Array.from(document.querySelectorAll('#stats-table th'))"
                               ".map(t => t.innerText).join('|').includes('rank 0|rank 1')",
                               timeout=20_000)
        assert not page.is_visible("#rank-graph-warning .banner-bad")  # same graph

        # KPIs of every run (all are overlaid): one line per rank of the distributed runs
        # (rank 2 of odd-ranks logged no loss), one for the single-process run
        page.click("text=KPIs")
        page.wait_for_function("(() => { const gd = document.querySelector('[data-kpi=loss] "
                               ".js-plotly-plot'); return gd && gd.data.filter(t => "
                               "t.showlegend !== false).length === 5; })()", timeout=20_000)
        names = page.evaluate("document.querySelector('[data-kpi=loss] .js-plotly-plot')"
                              ".data.filter(t => t.showlegend !== false).map(t => t.name)")
        assert names == ["ddp · rank 0", "ddp · rank 1", "odd-ranks · rank 0",
                         "odd-ranks · rank 1", "single"]

        # the spread strip: every rank's local loss and the global batch's
        page.click("text=Instruments")
        page.wait_for_selector("#rank-strip", state="visible", timeout=20_000)
        loss = wait_figure(page, "rank-loss", "gd.data.length === 3")
        assert [t["name"] for t in loss["data"]] == ["rank 0", "rank 1", "global batch"]
        for rank in (0, 1):
            np.testing.assert_allclose(loss["data"][rank]["y"],
                                       [local_loss(rank, s) for s in range(STEPS)])
        np.testing.assert_allclose(loss["data"][2]["y"], [
            (local_loss(0, s) + local_loss(1, s)) / 2 for s in range(STEPS)])
        assert "differ by up to" in page.inner_text("#rank-strip-summary")
        pick(page, "inst-layer", "out.weight")  # the gradient norm follows the layer
        norm = wait_figure(page, "rank-gradnorm", "gd.layout.meta.layer === 'out.weight'")
        assert norm["data"][0]["y"] == pytest.approx([local_norm(0, s) / 10
                                                      for s in range(STEPS)])
        pick(page, "rank-choice", "rank 1")   # the chosen rank stands out, the others fade
        chosen = wait_figure(page, "rank-loss", "gd.layout.meta.chosen === 1")
        assert chosen["data"][0]["opacity"] == 0.3 and chosen["data"][1]["line"]["width"] > 3

        # a 4-rank run: rank 3 missing, rank 2 a bad shard with another graph
        pick(page, "rank-choice", "global batch")
        pick(page, "run", "odd-ranks")
        page.wait_for_function("document.querySelector('#rank-status').innerText"
                               ".includes('rank 3 missing')", timeout=20_000)
        odd = wait_figure(page, "rank-loss", "gd.layout.meta.outlier === 2 && "
                          "gd.layout.meta.chosen === null")
        assert odd["data"][2]["line"]["width"] > 3  # the outlier stands out
        assert odd["data"][2]["name"] == "rank 2 (furthest from median)"
        assert "rank 2 is furthest from the median" in page.inner_text("#rank-strip-summary")
        page.screenshot(path=str(IMG / "gui-ranks.png"), full_page=True)
        page.click("text=Graph")
        page.wait_for_selector("#rank-graph-warning .banner-bad", timeout=20_000)
        assert "rank 2 recorded a different graph" in page.inner_text("#rank-graph-warning")
        # merged statistics need every rank: the chart says why they are missing
        wait_figure(page, "over-steps", "gd.layout.annotations && gd.layout.annotations[0]"
                    ".text.includes('rank 3 has no file')")

        # a single-process run: no selector, no strip, no warning
        pick(page, "run", "single")
        page.wait_for_selector("#rank-ctl", state="hidden", timeout=20_000)
        page.wait_for_selector("#rank-graph-warning .banner-bad", state="detached",
                               timeout=20_000)
        single = history(page, ["single"])
        assert "rank" not in single["layout"]["title"]["text"]
        page.click("text=Instruments")
        page.wait_for_selector("#inst-gradnorm .js-plotly-plot", timeout=20_000)
        assert not page.is_visible("#rank-strip")
        assert figure(page, "rank-loss") is not None
    finally:
        context.close()
