"""The example notebook runs headless (nbclient, the venv's python3 kernel): it trains with
the Lightning callback, shows the GUI inline and the dashboard as an image; the served page
answers on 127.0.0.1 while the kernel lives and stops answering after notebook.stop()."""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import deepscope

NOTEBOOK = Path(__file__).parents[2] / "examples" / "notebook.ipynb"


def test_example_notebook_shows_the_gui(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("lightning")
    pytest.importorskip("dash")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    src = str(Path(deepscope.__file__).parents[1])  # the kernel imports this deepscope
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})
    cells = [c for c in nb.cells if c.cell_type == "code"]
    with client.setup_kernel(env=env):
        for cell in cells[:-1]:
            client.execute_cell(cell, nb.cells.index(cell))
        html = next(o["data"]["text/html"] for o in cells[1].outputs
                    if "text/html" in o.get("data", {}))
        url = re.search(r'src="(http://127\.0\.0\.1:\d+/)"', html).group(1)
        with urllib.request.urlopen(url, timeout=30) as page:
            assert page.status == 200 and b"deepscope" in page.read()
        assert any("image/png" in o.get("data", {}) for o in cells[2].outputs)
        client.execute_cell(cells[-1], nb.cells.index(cells[-1]))
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url, timeout=5)
    with deepscope.open_run(tmp_path / "runs" / "notebook") as run:
        assert run.kpis("loss").step.tolist() == list(range(20))
        assert run.kpis("accuracy").step.tolist() == list(range(20))
