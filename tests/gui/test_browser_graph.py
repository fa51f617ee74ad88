"""The graph tab reads well (issue 21, item 5): one colour scale across runs, label text that
contrasts with its fill, no role legend while colouring by a value, a wide graph wrapped so
that its labels stay readable once fitted to the canvas."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import deepscope

from .conftest import start_server
from .test_browser import pick, wait_graph

pytestmark = pytest.mark.browser
CHAIN = 7  # tensors t0 -> t1 -> ... : seven layers, wider than the canvas


def _record(path: Path, run: str, scale: float) -> None:
    w = torch.nn.Parameter(torch.ones(4))
    with deepscope.Scope(path, run=run, schedule=1) as scope:
        with scope.step(0) as rec:
            x = torch.ones(3, 4) * scale
            rec.tensor("t0", x, role="input")
            for i in range(1, CHAIN):
                x = x * w * (i + 1)
                rec.tensor(f"t{i}", x, role="output" if i == CHAIN - 1 else "activation")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("graph")
    _record(path, "a_small", 1.0)
    _record(path, "b_big", 2.0)  # every value twice as large
    address, server = start_server(path)
    yield address
    server.shutdown()
    server.server_close()


@pytest.fixture
def page(browser, url: str) -> Iterator:
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(url)
    wait_graph(page)
    yield page
    page.close()


FILLS = "Object.fromEntries(cy.nodes().map(n => [n.id(), n.data('colour')]))"


def _contrast(a: str, b: str) -> float:
    def luminance(colour: str) -> float:
        channels = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_a_wide_graph_is_fitted_with_readable_labels(page) -> None:
    page.wait_for_function("cy.zoom() > 0 && cy.nodes().length === 7")
    font = page.evaluate("parseFloat(cy.nodes()[0].style('font-size')) * cy.zoom()")
    assert font >= 10, f"labels drawn at {font:.1f} px"
    inside = page.evaluate("""() => { const w = cy.width(), h = cy.height();
        return cy.nodes().every(n => { const b = n.renderedBoundingBox();
            return b.x1 >= 0 && b.y1 >= 0 && b.x2 <= w && b.y2 <= h; }); }""")
    assert inside


def test_colours_share_one_scale_and_labels_contrast(page) -> None:
    pick(page, "colour-by", "statistic: norm")
    page.wait_for_function("document.querySelector('#legend').innerText.includes('one scale')")
    small = page.evaluate(FILLS)
    legend = page.inner_text("#legend")
    assert "one scale with b_big" in legend and "activation" not in legend  # no role swatches
    for n in page.evaluate("cy.nodes().map(n => [n.data('colour'), n.data('text')])"):
        assert _contrast(*n) >= 4.5, n
    pick(page, "run", "b_big")
    page.wait_for_function("document.querySelector('#legend').innerText.includes('a_small')")
    big = page.evaluate(FILLS)
    # the largest norm is in b_big: only there does its node take the top colour
    assert big["t6"] == "#fde725" and small["t6"] != "#fde725"
    page.click("#colour-shared input")  # each run on its own scale again
    page.wait_for_function("!document.querySelector('#legend').innerText.includes('a_small')")
    assert page.evaluate(FILLS)["t6"] == "#fde725"
