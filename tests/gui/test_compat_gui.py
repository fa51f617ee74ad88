"""A run written through the comgra compatibility layer opens in the GUI."""

from __future__ import annotations

import pytest

from tests.test_compat_comgra import run_seed_example

from .conftest import start_server
from .test_browser import wait_graph
from .test_tutorial import select_node

pytestmark = pytest.mark.browser


def test_comgra_seed_run_opens_and_a_node_click_selects_it(browser, tmp_path) -> None:
    run_seed_example(str(tmp_path))
    url, server = start_server(tmp_path / "name_of_experiment_group")
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    try:
        page = context.new_page()
        page.goto(url)
        wait_graph(page)
        nodes = page.eval_on_selector_all(".node-btn", "bs => bs.map(b => b.dataset.node)")
        assert {"inputs", "outputs", "loss", "main_model.layer0"} <= set(nodes)
        select_node(page, "outputs")
        select_node(page, "inputs")
    finally:
        context.close()
        server.shutdown()
        server.server_close()
