"""The GUI in headless Chromium against runs recorded with the real recorder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import deepscope

from .conftest import STEPS, Net, record_run, start_server, train_step

pytestmark = pytest.mark.browser
IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
WIDTH = 1600


@pytest.fixture(scope="module")
def context(browser) -> Iterator:
    """One browser context per module: pages share its cache of the (large) scripts."""
    context = browser.new_context(viewport={"width": WIDTH, "height": 1000})
    yield context
    context.close()


@pytest.fixture
def page(context, gui_url: str) -> Iterator:
    page = context.new_page()
    page.outside = []  # requests that leave the server: must stay empty (no CDN)
    page.on("request", lambda r: None if r.url.startswith(gui_url) or r.url.startswith(
        "data:") else page.outside.append(r.url))
    page.goto(gui_url)
    wait_table(page, tensor="output", step=STEPS - 1)
    wait_graph(page)
    yield page
    assert page.outside == []
    page.close()


def wait_table(page, **expect: object) -> None:
    """Wait until the statistics table shows the expected tensor / step / direction."""
    checks = " && ".join(f"t.dataset.{k} === {json.dumps(str(v))}" for k, v in expect.items())
    page.wait_for_function(f"(() => {{ const t = document.querySelector('#stats-table "
                           f"table'); return t && {checks}; }})()", timeout=20_000)


def wait_graph(page) -> None:
    """Wait until cytoscape drew the graph and the node list exists."""
    page.wait_for_function("window.cy && cy.nodes().length > 0 && "
                           "document.querySelectorAll('.node-btn').length > 0", timeout=20_000)


def node_names(page) -> list[str]:
    """The nodes the page lists (the keyboard-accessible node buttons)."""
    return page.eval_on_selector_all(".node-btn", "bs => bs.map(b => b.dataset.node)")


def open_graph(browser, url: str):
    """A 1600×1000 page on `url` with its graph drawn: (context, page); close the context."""
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    try:
        page = context.new_page()
        page.goto(url)
        wait_graph(page)
    except BaseException:
        context.close()
        raise
    return context, page


def figure(page, graph_id: str) -> dict:
    """data and layout of a plotly chart as drawn in the page."""
    return page.evaluate("(id) => { const gd = document.querySelector('#' + id + "
                         "' .js-plotly-plot'); return gd ? {data: gd.data, layout: "
                         "gd.layout} : null; }", graph_id)


def wait_figure(page, graph_id: str, condition: str) -> dict:
    """Wait until `condition` (JS over `gd`) holds for a chart, and return it. A chart kept
    blank ("stale") until it comes near the window (a dashboard's charts below it) is
    scrolled to."""
    page.wait_for_function(f"""(() => {{
        const el = document.getElementById('{graph_id}');
        const gd = el && el.querySelector('.js-plotly-plot');
        const kept = el && el.closest('.stale');
        if (kept) {{ el.scrollIntoView({{block: 'nearest'}}); }}
        return gd && gd.layout && !kept && ({condition}); }})()""", timeout=20_000)
    return figure(page, graph_id)


def draw_all(page) -> None:
    """Draw every chart kept until it comes near the window (before a picture of the whole
    page, as printing does), and wait until plotly drew them."""
    page.evaluate("""() => new Promise((resolve) => {
        const kept = [...document.querySelectorAll('.stale .js-plotly-plot')];
        let left = kept.length;
        const done = () => { left -= 1; if (left <= 0) { resolve(); } };
        kept.forEach((gd) => gd.once('plotly_afterplot', done));
        setTimeout(resolve, 15000);
        if (!left) { resolve(); }
        window.deepscope.drawAll();
    })""")
    page.wait_for_function("!document.querySelector('.stale')", timeout=20_000)


def pick(page, dropdown_id: str, label: str) -> None:
    """Choose an option of a dcc.Dropdown by its label."""
    page.click(f"#{dropdown_id}")
    page.click(f"[role=listbox] [role=option]:has-text('{label}')")
    page.keyboard.press("Escape")


def table_values(page) -> list[str]:
    return page.eval_on_selector_all("#stats-table td", "tds => tds.map(t => t.textContent)")


def test_graph_renders_fits_the_window_and_uses_only_local_assets(page) -> None:
    labels = page.evaluate("window.cy.nodes().map(n => n.data('label'))")
    assert set(labels) >= {"input", "pre  [2]", "hidden", "out  [2]", "output",
                           "loss  [2]", "target"}
    assert set(node_names(page)) == {"input", "pre", "hidden", "out", "output", "loss", "target"}
    # nothing overflows a 1600 px window, and the fitted graph lies inside its box
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
    box = page.eval_on_selector("#graph", "e => e.getBoundingClientRect().toJSON()")
    assert box["right"] <= WIDTH
    inside = page.evaluate("""() => { const w = cy.width(), h = cy.height();
        return cy.nodes().every(n => { const b = n.renderedBoundingBox();
            return b.x1 >= 0 && b.y1 >= 0 && b.x2 <= w && b.y2 <= h; }); }""")
    assert inside
    # inputs on the left, the loss on the right
    xs = page.evaluate("Object.fromEntries(cy.nodes().map(n => [n.id(), n.position('x')]))")
    assert xs["input"] == min(xs.values()) and xs["loss"] == max(xs.values())
    html = page.content()
    assert "cdn" not in html.lower() and "bootstrap" not in html.lower()
    IMG.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMG / "graph_view.png"), full_page=True)


def test_selecting_a_node_changes_the_output_to_that_tensor(page) -> None:
    page.dispatch_event('.node-btn[data-node="hidden"]', "click")
    wait_table(page, tensor="hidden")
    assert page.eval_on_selector("#node", "e => e.textContent").startswith("hidden")
    classes = page.evaluate("cy.$id('hidden').classes()")
    assert "selected" in classes
    assert "lit" in page.evaluate("cy.$id('input').classes()")       # what it depends on
    assert "faded" in page.evaluate("cy.$id('target').classes()")    # unrelated
    # clicking the node in the graph (a real mouse click on the canvas) selects too
    x, y = page.evaluate("""(() => { const p = cy.$id('input').renderedPosition();
        const box = cy.container().getBoundingClientRect();
        return [box.left + p.x, box.top + p.y]; })()""")
    page.mouse.click(x, y)
    wait_table(page, tensor="input")
    assert page.eval_on_selector("#node", "e => e.textContent").startswith("input")
    pick(page, "node", "pre (parameter)")
    wait_table(page, tensor="pre.weight")
    pick(page, "tensor", "bias — pre.bias")
    wait_table(page, tensor="pre.bias")


def test_step_slider_keys_and_over_steps_chart(page) -> None:
    before = table_values(page)
    history = wait_figure(page, "over-steps", "gd.layout.meta && gd.layout.meta.tensor "
                          "=== 'output'")
    assert history["data"][0]["x"] == list(range(STEPS))   # one point per recorded step
    page.keyboard.press("ArrowLeft")                         # ← steps back (keys.js)
    wait_table(page, step=STEPS - 2)
    assert table_values(page) != before
    page.focus("#step-slider [role=slider]")
    page.keyboard.press("Home")                              # move the slider itself
    wait_table(page, step=0)
    wait_figure(page, "values-chart", "gd.layout.meta.step === 0")
    wait_figure(page, "over-steps", "gd.layout.shapes[0].x0 === 0")     # the step marker
    assert "step 0" in page.inner_text("#step-label")
    # gradients and batch items
    page.click("#direction [role=option]:has-text('gradient')")
    wait_table(page, direction="grad")
    pick(page, "batch", "sample 1")
    values = wait_figure(page, "values-chart", "gd.layout.meta.view === 'samples'")
    assert "batch item 1" in values["layout"]["title"]["text"]
    items = figure(page, "items-chart")
    assert len(items["data"][0]["x"]) == 4                   # one bar per batch item


def test_colour_by_a_statistic_tints_the_nodes(page) -> None:
    role_colour = page.evaluate("cy.$id('hidden').data('colour')")
    pick(page, "colour-by", "statistic: norm")
    page.wait_for_selector(".colourbar")
    page.wait_for_function(f"cy.$id('hidden').data('colour') !== '{role_colour}'")
    assert "norm of forward values" in page.inner_text("#legend")


def test_instruments_tab_shows_the_dashboard(page) -> None:
    page.click("text=Instruments")
    norm = wait_figure(page, "inst-gradnorm", "gd.data.length > 0")
    assert norm["data"][0]["x"] == list(range(STEPS))
    hist = wait_figure(page, "inst-hist1d", "gd.data.length > 0")
    assert hist["data"][0]["type"] == "heatmap" and len(hist["data"][0]["x"]) == STEPS
    tests = wait_figure(page, "inst-tests", "gd.data.length === 3")
    assert {t["name"] for t in tests["data"]} == {"NormTest", "InnerTest", "OrthoTest"}
    curvature = wait_figure(page, "inst-hessmaxev", "gd.layout.annotations")
    assert "not tracked" in curvature["layout"]["annotations"][0]["text"]
    perf = wait_figure(page, "inst-performance", "gd.data.length > 0")
    assert "kpi: loss" in {t["name"] for t in perf["data"]}
    # per layer: GradNorm of one parameter
    pick(page, "inst-layer", "pre.weight")
    wait_figure(page, "inst-gradnorm", "gd.data.length && gd.data[0].y[1] > "
                f"{norm['data'][0]['y'][1] + 1e-9}")
    page.mouse.move(0, 0)  # no hover toolbar in the picture
    draw_all(page)
    page.screenshot(path=str(IMG / "instruments.png"), full_page=True)


def test_instruments_tab_shows_warnings_beside_the_quantities(page) -> None:
    page.click("text=Instruments")
    page.wait_for_selector("#inst-warnings-1 p")
    step_size = page.inner_text("#inst-warnings-0")  # the section with GradNorm
    gradients = page.inner_text("#inst-warnings-1")  # the section with the gradient tests
    assert "BatchNorm1d 'bn': in train mode" in step_size and "affects GradNorm" in step_size
    assert "affects NormTest, InnerTest" in gradients
    assert page.inner_text("#inst-warnings-2") == ""
    # runs without warnings show none
    pick(page, "run", "other")
    page.wait_for_function("document.querySelector('#inst-warnings-1').innerText === ''")
    assert not page.is_visible("#inst-warnings-0")


def test_kpis_notes_and_compare_tabs(page) -> None:
    page.click("text=KPIs")
    page.wait_for_selector("[data-kpi=loss] .js-plotly-plot")
    kpi = page.evaluate("document.querySelector('[data-kpi=loss] .js-plotly-plot').data"
                        ".map(t => t.name)")
    assert {"base", "other", "base (raw)"} <= set(kpi)
    page.click("text=Notes")
    page.wait_for_selector("#notes td:has-text('base: lr=0.1')")
    page.click("text=Diagnosis")
    page.wait_for_selector("#anomalies:has-text('No anomalies')")
    assert "Diagnosis of base" in page.inner_text("#anomalies")
    page.click("text=Compare")
    pick(page, "compare-b", "other")
    page.wait_for_selector("#compare-b-table table[data-tensor=output]")
    both = wait_figure(page, "compare-over-steps", "gd.data.length === 2")
    assert [t["name"] for t in both["data"]] == ["base", "other"]
    assert page.inner_text("#compare-a-table") != page.inner_text("#compare-b-table")
    page.screenshot(path=str(IMG / "compare.png"), full_page=True)


def test_two_browser_tabs_keep_separate_selections(browser, gui_url: str) -> None:
    pages = []
    for node in ("hidden", "input"):
        context = browser.new_context(viewport={"width": WIDTH, "height": 1000})
        p = context.new_page()
        p.goto(gui_url)
        wait_table(p, tensor="output")
        wait_graph(p)
        p.dispatch_event(f'.node-btn[data-node="{node}"]', "click")
        wait_table(p, tensor=node)
        pages.append(p)
    pages[1].keyboard.press("ArrowLeft")
    wait_table(pages[1], tensor="input", step=STEPS - 2)
    pages[0].wait_for_timeout(2500)                       # a poll passes in both
    wait_table(pages[0], tensor="hidden", step=STEPS - 1)
    for p in pages:
        p.context.close()


def test_a_failing_panel_or_run_shows_its_error_and_the_rest_still_works(
        page, monkeypatch: pytest.MonkeyPatch) -> None:
    from deepscope.gui import panels

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated failure")
    monkeypatch.setattr(panels, "values_panel", broken)
    page.dispatch_event('.node-btn[data-node="hidden"]', "click")
    wait_table(page, tensor="hidden")                     # the table still updates
    failed = wait_figure(page, "values-chart", "gd.layout.annotations")
    assert "simulated failure" in failed["layout"]["annotations"][0]["text"]
    monkeypatch.undo()
    # a damaged run says what is wrong with it; the other runs stay usable
    pick(page, "run", "zz-damaged")
    page.wait_for_selector("#stats-table .panel-error:has-text('not a deepscope store')")
    pick(page, "run", "other")
    page.wait_for_selector("#stats-table table[data-tensor=hidden]")


def test_a_failing_instrument_panel_shows_its_error_and_the_others_draw(
        browser, project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All Instruments panels are drawn by one callback: one panel's failure stays in it.
    (A server of its own: the module's keeps the answers it built, per run version.)"""
    from deepscope.gui.tabs import instruments

    plain = instruments.render_panel

    def render(rd: object, panel: instruments.Panel, layer: str) -> object:
        if panel.title == instruments.PANELS["gradnorm"].title:
            raise RuntimeError("simulated failure")
        return plain(rd, panel, layer)
    monkeypatch.setattr(instruments, "render_panel", render)
    url, server = start_server(project)
    context, page = open_graph(browser, url)
    try:
        page.click("text=Instruments")
        failed = wait_figure(page, "inst-gradnorm", "gd.layout.annotations")
        assert "simulated failure" in failed["layout"]["annotations"][0]["text"]
        tests = wait_figure(page, "inst-tests", "gd.data.length === 3")
        assert {t["name"] for t in tests["data"]} == {"NormTest", "InnerTest", "OrthoTest"}
    finally:
        context.close()
        server.shutdown()
        server.server_close()


def test_new_steps_and_structures_appear_without_reload(browser, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = deepscope.Scope(tmp_path, run="live", schedule=deepscope.every(1), max_samples=2)
    scope.watch(model)
    for step in range(2):
        train_step(scope, model, opt, step)
    scope.flush()
    url, server = start_server(tmp_path)
    context = browser.new_context(viewport={"width": WIDTH, "height": 1000})
    try:
        page = context.new_page()
        page.goto(url)
        wait_table(page, tensor="output", step=1)
        page.evaluate("window.__same_page = true")
        train_step(scope, model, opt, 2)
        scope.flush()
        wait_table(page, step=2)                         # the newest step is followed
        page.wait_for_function("document.querySelector('#step-label').textContent"
                               ".includes('3 of 3')")
        x = torch.randn(4, 5)
        with scope.step(3, kind="eval") as rec:           # a new kind with a new structure
            rec.tensor("input", x, role="input")
            out = model(x, rec)
            rec.tensor("output", out, role="output")
            doubled = out * 2
            rec.tensor("doubled", doubled)
            rec.loss(doubled.pow(2).mean())
            doubled.pow(2).mean().backward()
        scope.flush()
        page.click("#kind")
        page.wait_for_selector("[role=listbox] [role=option]:has-text('eval')",
                               timeout=10_000)
        page.keyboard.press("Escape")
        pick(page, "kind", "eval")
        wait_table(page, step=3)
        page.wait_for_selector('.node-btn[data-node="doubled"]', state="attached")
        assert "doubled" in page.evaluate("cy.nodes().map(n => n.id())")
        assert page.evaluate("window.__same_page") is True   # never reloaded
    finally:
        scope.close()
        context.close()
        server.shutdown()
        server.server_close()


def test_a_folder_without_runs_shows_a_clear_page_then_opens_the_first_run(
        browser, tmp_path: Path) -> None:
    url, server = start_server(tmp_path / "missing")
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(url)
        assert "does not exist" in page.inner_text("#empty-reason")
        (tmp_path / "missing").mkdir()
        page.reload()
        assert "No runs in" in page.inner_text("#empty-reason")
        assert "Traceback" not in page.content()
        record_run(tmp_path / "missing", "first", steps=2, instruments=False)
        # the page reloads itself into the GUI once the run exists
        page.wait_for_selector("#stats-table table[data-step='1']", timeout=30_000)
    finally:
        context.close()
        server.shutdown()
        server.server_close()
