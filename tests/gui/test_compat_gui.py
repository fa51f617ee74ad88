"""A run written through the comgra compatibility layer opens in the GUI."""

from __future__ import annotations

import pytest

from tests.test_compat_comgra import run_seed_example

from .conftest import start_server
from .test_browser import node_names, open_graph
from .test_tutorial import select_node

pytestmark = pytest.mark.browser


def test_comgra_seed_run_opens_and_a_node_click_selects_it(browser, tmp_path) -> None:
    run_seed_example(str(tmp_path))
    url, server = start_server(tmp_path / "name_of_experiment_group")
    context, page = open_graph(browser, url)
    try:
        assert {"inputs", "outputs", "loss", "main_model.layer0"} <= set(node_names(page))
        select_node(page, "outputs")
        select_node(page, "inputs")
    finally:
        context.close()
        server.shutdown()
        server.server_close()
