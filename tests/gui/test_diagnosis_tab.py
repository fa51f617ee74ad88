"""The Diagnosis tab in headless Chromium: a run with a bug lists its diagnosis; clicking the
row opens the graph tab at the step and node it names, also when the run was chosen while
the graph tab was hidden."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.diagnosis.zoo import cases, train

from .conftest import start_server
from .test_browser import pick, wait_graph, wait_table

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def bugged_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A run whose optimiser was given the last layer only (not_updated at 0.*, step 0), and
    its healthy twin (zz-ok)."""
    path = tmp_path_factory.mktemp("diag") / "runs"
    _, bugged, healthy = cases()["not_updated"]
    train(path, "bug", bugged()).close()
    train(path, "zz-ok", healthy()).close()
    url, server = start_server(path)
    yield url
    server.shutdown()
    server.server_close()


def test_diagnosis_row_opens_its_step_and_node(browser, bugged_url: str) -> None:
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(bugged_url)
    wait_graph(page)
    page.click("text=Diagnosis")
    page.wait_for_selector("#anomalies td.diag-code:has-text('not_updated')")
    text = page.inner_text("#anomalies")
    assert "Health-check findings" in text and "0.bias" in text
    assert not page.is_visible("#graph")
    page.click("#anomalies button.diag-go:has-text('0.weight')")
    # the graph tab shows node 0 (the first Linear) with 0.weight selected at step 0
    wait_table(page, tensor="0.weight", step=0)
    # switched to the graph tab: the same answer sets the tab, whose pane the browser shows
    # one step later (layout.register_panes)
    page.wait_for_selector("#graph", state="visible", timeout=20_000)
    assert page.inner_text("#node").strip().startswith("0 (")  # the node of 0.weight
    page.close()


def test_a_row_opens_in_the_run_chosen_while_the_graph_tab_was_hidden(
        browser, bugged_url: str) -> None:
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(bugged_url)
    wait_graph(page)
    pick(page, "run", "zz-ok")
    wait_table(page, run="zz-ok")
    page.click("text=Diagnosis")
    pick(page, "run", "bug")            # the hidden graph tab still shows zz-ok
    page.click("#anomalies button.diag-go:has-text('0.weight')")
    # one answer selects the row's step and node and shows the tab; the tab then catching
    # up with the run keeps them
    wait_table(page, tensor="0.weight", step=0, run="bug")
    page.wait_for_timeout(500)
    wait_table(page, tensor="0.weight", step=0, run="bug")
    page.close()
