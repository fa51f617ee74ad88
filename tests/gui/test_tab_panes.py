"""Every tab stays mounted and the strip only hides the others (issue 21, latency): a tab
switch remounts nothing and asks the server nothing when the content is current; a hidden tab
neither asks nor redraws, and catches up when shown; a long dashboard draws the charts below
the window when scrolled to, blank (never another run's numbers) until then."""

from __future__ import annotations

import json

import pytest

from . import test_browser
from .conftest import STEPS
from .test_browser import figure, pick, wait_figure, wait_table

pytestmark = pytest.mark.browser
context, page = test_browser.context, test_browser.page  # fixtures: a page with its graph


def dash_requests(page) -> list[list[str]]:
    """From now on: the outputs of every callback request the page sends (not the poll)."""
    sent: list[list[str]] = []

    def log(request) -> None:
        if "_dash-update-component" not in request.url:
            return
        body = json.loads(request.post_data or "{}")
        if '"poll"' in json.dumps(body.get("inputs")):
            return
        outputs = body.get("outputs")
        sent.append([o["id"] for o in (outputs if isinstance(outputs, list) else [outputs])])
    page.on("request", log)
    return sent


def open_tab(page, label: str) -> None:
    page.click(f"#tabs .tab:has-text('{label}')")


def mark(page, selector: str) -> None:
    page.eval_on_selector(selector, "el => { el.__mark = true; }")


def marked(page, selector: str) -> bool:
    return page.eval_on_selector(selector, "el => el.__mark === true")


def test_a_tab_switch_remounts_nothing_and_asks_nothing(page) -> None:
    page.wait_for_selector("#live-status:has-text('live')")  # the runs' versions arrived
    open_tab(page, "Instruments")
    wait_figure(page, "inst-gradnorm", "gd.data.length > 0")
    charts = ("#inst-gradnorm .js-plotly-plot", "#values-chart .js-plotly-plot", "#graph")
    for selector in charts:
        mark(page, selector)
    sent = dash_requests(page)
    for label in ("Graph", "Instruments", "Graph"):
        open_tab(page, label)
        page.wait_for_timeout(400)
    assert page.is_visible("#graph") and not page.is_visible("#inst-gradnorm")
    assert sent == []                                     # content current: no request
    assert all(marked(page, s) for s in charts)           # the same drawn charts, kept


def test_a_hidden_graph_tab_waits_and_catches_up_when_shown(page) -> None:
    wait_table(page, tensor="output", step=STEPS - 1, run="base")
    open_tab(page, "Instruments")
    wait_figure(page, "inst-gradnorm", "gd.data.length > 0")
    sent = dash_requests(page)
    pick(page, "run", "other")                            # a run without instruments
    wait_figure(page, "inst-gradnorm", "gd.layout.annotations && gd.layout.annotations"
                ".some(a => a.text.includes('not tracked'))")
    page.evaluate("document.activeElement.blur()")
    page.keyboard.press("ArrowLeft")   # steps only the graph tab shown (here: hidden)
    page.wait_for_timeout(400)
    outputs = {o for request in sent for o in request}
    assert outputs and not outputs & {"sel", "graph", "over-steps", "stats-table"}, outputs
    open_tab(page, "Graph")
    wait_table(page, tensor="output", step=STEPS - 1, run="other")  # not STEPS - 2


def test_a_run_switch_draws_the_window_and_the_rest_when_scrolled_to(page) -> None:
    """One answer carries every Instruments chart; the charts in the window are drawn at
    once, those below it when scrolled near, blank until then (never the previous run's
    numbers), and each then shows the new run's."""
    open_tab(page, "Instruments")
    wait_figure(page, "inst-gradnorm", "gd.data.length > 0")
    last = "#inst-performance"                            # the last row, below the window
    assert page.eval_on_selector(last, "el => el.getBoundingClientRect().top") > 1000
    assert figure(page, "inst-performance")["data"] == []  # not drawn yet
    assert page.eval_on_selector(last, "el => !!el.closest('.stale')")
    perf = wait_figure(page, "inst-performance", "gd.data.length > 0")  # scrolls to it
    assert "kpi: loss" in {t["name"] for t in perf["data"]}
    page.evaluate("window.scrollTo(0, 0)")
    page.wait_for_timeout(200)
    mark(page, "#inst-gradnorm .js-plotly-plot")
    pick(page, "run", "other")                            # a run without instruments
    wait_figure(page, "inst-gradnorm", "gd.layout.annotations && gd.layout.annotations"
                ".some(a => a.text.includes('not tracked'))")  # in the window: at once
    assert marked(page, "#inst-gradnorm .js-plotly-plot")  # the same chart, redrawn
    assert page.eval_on_selector(last, "el => !!el.closest('.stale')")
    assert not page.is_visible("#inst-performance .js-plotly-plot")
    base_loss = perf["data"][0]["y"][0]
    other = wait_figure(page, "inst-performance", f"gd.data[0].y[0] !== {base_loss!r}")
    assert [t["name"] for t in other["data"]] == ["kpi: loss"]
    assert page.evaluate("window.deepscope.pending()") == []  # all drawn, scrolled down


def test_charts_kept_on_a_hidden_tab_are_drawn_when_it_is_shown(page) -> None:
    """A chart kept blank while the tab was hidden is drawn when the tab is shown with the
    chart in the window (the page's scroll position is shared by every tab)."""
    open_tab(page, "Instruments")
    wait_figure(page, "inst-gradnorm", "gd.data.length > 0")
    assert "inst-performance" in page.evaluate("window.deepscope.pending()")
    open_tab(page, "Graph")
    page.wait_for_timeout(300)
    page.set_viewport_size({"width": 1600, "height": 2200})  # every chart fits the window
    page.wait_for_timeout(300)
    assert "inst-performance" in page.evaluate("window.deepscope.pending()")  # tab hidden
    open_tab(page, "Instruments")
    perf = wait_figure(page, "inst-performance", "gd.data.length > 0")
    assert "kpi: loss" in {t["name"] for t in perf["data"]}
    assert page.evaluate("window.deepscope.pending()") == []


def instruments_answer(page, action) -> dict:
    """The outputs the server's Instruments answer to `action()` sends ({id: {prop: ...}})."""
    with page.expect_response(lambda r: "_dash-update-component" in r.url
                              and "inst-figures" in (r.request.post_data or "")) as info:
        action()
    return info.value.json()["response"]


def test_a_run_switch_sends_only_what_changed(page) -> None:
    """Warnings and layer choices equal to those shown are not sent again (the page then
    re-renders neither); the figures always are."""
    open_tab(page, "Instruments")
    wait_figure(page, "inst-gradnorm", "gd.data.length > 0")
    page.wait_for_selector("#inst-warnings-0 p")          # base's warning
    sent = instruments_answer(page, lambda: pick(page, "run", "other"))
    assert {"inst-figures", "inst-warnings-0", "inst-layer"} <= set(sent)
    page.wait_for_function("document.querySelector('#inst-warnings-0').innerText === ''")
    # recurrent, like other, has no warning and no per-layer quantity
    sent = instruments_answer(page, lambda: pick(page, "run", "recurrent"))
    assert "inst-figures" in sent and "inst-drawn" in sent
    assert not {k for k in sent if k.startswith("inst-warnings") or k == "inst-layer"}, sent
    assert page.inner_text("#inst-warnings-0") == ""
