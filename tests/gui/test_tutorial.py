"""docs/tutorial.md clicked through in headless Chromium on a short demo recording.

One test follows the tutorial's instructions in order, asserts at each step what the reader is
told to see there, and saves the tutorial's screenshots (docs/img/tutorial_*.png).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

import deepscope
from deepscope.demo import DemoConfig, run_demo
from deepscope.gui.graph_view import MISSING_COLOUR

from .conftest import start_server
from .test_browser import IMG, WIDTH, draw_all, figure, pick, wait_figure, wait_graph, wait_table

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.browser
STEPS = 300          # as in tests/test_demo.py: enough steps for the two runs to part
KIND, LAST = "len_08", 7   # the longest sequences, and their last iteration
TENSOR = "out.pre_sigmoid"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(GUI url, project folder) of the demo recorded with STEPS steps per run."""
    path = tmp_path_factory.mktemp("tutorial") / "deepscope-demo"
    run_demo(path, steps=STEPS, progress=False)
    url, server = start_server(path)
    yield url, path
    server.shutdown()
    server.server_close()


def open_tab(page: Page, label: str) -> None:
    """Show one of the tabs below the header."""
    page.click(f"#tabs .tab:has-text('{label}')")


def stat(page: Page, name: str, table: str = "#stats-table", column: str = "forward") -> float:
    """One statistic of a statistics table, as shown."""
    text = page.evaluate("""([root, name, column]) => {
        const t = document.querySelector(root + ' table');
        const col = [...t.querySelectorAll('thead th')].map(h => h.textContent).indexOf(column);
        const row = [...t.querySelectorAll('tbody tr')].find(
            r => r.querySelector('th').textContent === name);
        return row.children[col].textContent; }""", [table, name, column])
    return float(text)


def shoot(page: Page, name: str, *selectors: str) -> None:
    """Save docs/img/tutorial_<name>.png: the region around `selectors`, or the whole page."""
    page.mouse.move(0, 0)  # no hover labels or toolbars in the picture
    draw_all(page)
    path = str(IMG / f"tutorial_{name}.png")
    if not selectors:
        page.screenshot(path=path, full_page=True)
        return
    clip = page.evaluate("""(selectors) => {
        const boxes = selectors.map(s => document.querySelector(s).getBoundingClientRect());
        const pad = 4, x = Math.max(Math.min(...boxes.map(b => b.left)) - pad, 0),
              y = Math.max(Math.min(...boxes.map(b => b.top)) - pad, 0);
        return {x: x + scrollX, y: y + scrollY,
                width: Math.max(...boxes.map(b => b.right)) + pad - x,
                height: Math.max(...boxes.map(b => b.bottom)) + pad - y}; }""", list(selectors))
    page.screenshot(path=path, full_page=True, clip=clip)


def traces(fig: dict) -> dict[str, list[float]]:
    """Trace name -> y values of a drawn chart."""
    return {t["name"]: [y for y in t["y"] if y is not None] for t in fig["data"]}


def select_node(page: Page, node: str) -> None:
    """Select a node as a click in the graph does (through the hidden node list).

    A click that lands while the previous selector's update is still in flight can be
    superseded by it, so the click is repeated once if the table did not follow."""
    page.dispatch_event(f'.node-btn[data-node="{node}"]', "click")
    try:
        wait_table(page, tensor=node)
    except PlaywrightTimeout:
        page.dispatch_event(f'.node-btn[data-node="{node}"]', "click")
        wait_table(page, tensor=node)


def directions(page: Page) -> list[str]:
    """The choices of the Values selector."""
    return page.eval_on_selector_all("#direction label", "ls => ls.map(l => l.textContent)")


def test_tutorial_walkthrough(browser: Browser, demo: tuple[str, Path]) -> None:
    url, path = demo
    with deepscope.open_run(path / "bugged") as run:
        last_step = run.steps(KIND)[-1]
    IMG.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": WIDTH, "height": 1000})
    try:
        page = context.new_page()
        page.goto(url)
        wait_table(page, tensor="output")
        assert page.inner_text("#run") == "bugged"
        # The header names the project folder: a reader's, not this test's temporary one.
        page.eval_on_selector(".topbar .project", "e => e.textContent = "
                              "'/home/you/deepscope-demo'")

        # 2. KPIs: both runs overlaid, smoothing 0.6; the fixed run ends lower.
        open_tab(page, "KPIs")
        assert page.get_attribute("#kpi-smooth [role=slider]", "aria-valuenow") == "0.6"
        page.wait_for_selector("[data-kpi=accuracy] .js-plotly-plot")
        loss = traces(figure(page, "kpi-charts [data-kpi=loss]"))
        assert set(loss) == {"bugged", "fixed", "bugged (raw)", "fixed (raw)"}
        assert len(loss["bugged"]) == len(loss["fixed"]) == STEPS
        tail = STEPS // 5
        assert sum(loss["fixed"][-tail:]) < sum(loss["bugged"][-tail:]) - 0.05 * tail
        assert loss["bugged"][0] == pytest.approx(0.69, abs=0.02)   # guessing at first
        shoot(page, "kpis")

        # 3. Graph: kind len_08, its last iteration; out.pre_sigmoid and its cone lit.
        open_tab(page, "Graph")
        wait_graph(page)
        pick(page, "kind", KIND)
        wait_table(page, step=last_step)
        pick(page, "iteration", f"iteration {LAST}")
        page.wait_for_selector(f"#stats-table caption:has-text('iteration {LAST}')")
        select_node(page, TENSOR)
        page.wait_for_function(f"cy.$id('{TENSOR}').hasClass('selected')")
        classes = page.evaluate("Object.fromEntries(cy.nodes().map(n => [n.id(), n.classes()]))")
        for lit in ("input", "pre", "pre.hidden", "pre.out", "out", "out.hidden", "output",
                    "loss"):
            assert "lit" in classes[lit], lit
        for faded in ("target", "partial_sum", "memory.out"):
            assert "faded" in classes[faded], faded
        labels = page.evaluate("cy.nodes().map(n => n.data('label'))")
        assert {"pre  [4]", "memory  [4]", "out  [4]", "loss  [2]"} <= set(labels)
        assert page.evaluate("cy.edges('.lagged').length") > 0   # memory.out of iteration 6
        shoot(page, "graph")

        # ... a gradient reaches out.pre_sigmoid in the last iteration only.
        assert directions(page) == ["forward", "gradient"]
        pick(page, "iteration", "iteration 0")
        page.wait_for_function("document.querySelectorAll('#direction label').length === 1")
        assert directions(page) == ["forward"]
        pick(page, "iteration", f"iteration {LAST}")
        page.wait_for_selector(f"#stats-table caption:has-text('iteration {LAST}')")
        # ... the loss per batch item.
        select_node(page, "loss")
        pick(page, "tensor", "per_sample — loss_per_sample")
        wait_table(page, tensor="loss_per_sample")
        items = wait_figure(page, "items-chart", "gd.data.length > 0")
        assert len(items["data"][0]["x"]) == DemoConfig.batch      # one bar per sequence
        # ... the task by eye: the target is the sign of the partial sum (batch item 0).
        select_node(page, "partial_sum")
        pick(page, "batch", "sample 0")
        sums = wait_figure(page, "values-chart", "gd.layout.meta.view === 'samples' && "
                           "gd.layout.meta.tensor === 'partial_sum'")["data"][0]["y"]
        select_node(page, "target")
        target = wait_figure(page, "values-chart", "gd.layout.meta.tensor === 'target'")
        assert target["data"][0]["y"] == [float(v > 0) for v in sums]
        pick(page, "batch", "mean over batch")

        # 4. The bug: output never goes near 0; its logits are lopsided.
        select_node(page, "output")
        assert 0.4 < stat(page, "min") < 0.5
        select_node(page, TENSOR)
        low, high = stat(page, "min"), stat(page, "max")
        assert low < 0 and -low < high / 10, (low, high)
        assert f"{TENSOR} · step {last_step} · iteration {LAST}" in page.inner_text(
            "#stats-table caption")
        bars = wait_figure(page, "values-chart", f"gd.layout.meta.tensor === '{TENSOR}'")
        assert bars["layout"]["meta"]["view"] == "neuron_mean" and bars["data"][0]["type"] == "bar"
        means = bars["data"][0]["y"]
        assert len(means) == 5 and max(means) > 1 and min(means) > -0.1   # one bar per logit
        shoot(page, "pre_sigmoid", "#stats-table", "#values-chart")

        # 5. Statistic over steps = min, overlaid with the fixed run.
        pick(page, "statistic", "min")
        pick(page, "overlay", "fixed")
        history = wait_figure(page, "over-steps", "gd.layout.meta.statistic === 'min' && "
                              "gd.data.length === 2")
        mins = traces(history)
        assert -1 < min(mins["bugged"]) < 0 and max(mins["bugged"]) < 0   # just below zero
        assert min(mins["fixed"]) < 10 * min(mins["bugged"])
        shoot(page, "min_over_steps", ".output .toolbar", "#over-steps")

        # ... the Compare tab: the same record in both runs.
        open_tab(page, "Compare")
        pick(page, "compare-b", "fixed")
        page.wait_for_selector(f"#compare-b-table table[data-tensor='{TENSOR}']")
        page.wait_for_selector(f"#compare-a-table table[data-tensor='{TENSOR}']")
        assert page.inner_text("#compare-a-title").startswith("bugged · step")
        assert page.inner_text("#compare-b-title").startswith("fixed · step")
        fixed_low = stat(page, "min", "#compare-b-table")
        fixed_high = stat(page, "max", "#compare-b-table")
        assert fixed_low < 10 * stat(page, "min", "#compare-a-table")
        assert 1 / 3 < -fixed_low / fixed_high < 3                   # about symmetric
        both = wait_figure(page, "compare-over-steps", "gd.data.length === 2")
        assert [t["name"] for t in both["data"]] == ["bugged", "fixed"]
        wait_figure(page, "compare-b-values", "gd.data.length > 0")
        shoot(page, "compare")

        # 6. Instruments of the bugged run, whole model: every panel has data.
        open_tab(page, "Instruments")
        for key in ("alpha", "distance", "gradnorm", "tests", "hist1d", "snr", "hessmaxev",
                    "hesstrace", "tic", "performance"):
            panel = wait_figure(page, f"inst-{key}", "gd.data.length > 0")
            assert "not tracked" not in str(panel["layout"].get("annotations")), key
        assert page.inner_text("#inst-layer") == "whole model"
        tests = figure(page, "inst-tests")
        assert {t["name"] for t in tests["data"]} == {"NormTest", "InnerTest", "OrthoTest"}
        assert figure(page, "inst-hist1d")["data"][0]["type"] == "heatmap"
        assert "kpi: accuracy" in traces(figure(page, "inst-performance"))
        shoot(page, "instruments")

        # ... Colour by quantity: GradNorm tints the parameter nodes.
        open_tab(page, "Graph")
        wait_graph(page)
        pick(page, "colour-by", "quantity: GradNorm")
        page.wait_for_selector(".colourbar")
        assert "GradNorm at step" in page.inner_text("#legend")
        colours = page.evaluate("Object.fromEntries(cy.nodes().map(n => [n.id(), "
                                "n.data('colour')]))")
        tinted = {n for n, c in colours.items() if c != MISSING_COLOUR}   # else: no value
        assert tinted == {"pre", "memory", "out"}
        shoot(page, "colour_gradnorm", ".graph-card")
    finally:
        context.close()
