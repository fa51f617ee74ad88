"""The example notebook runs headless (nbclient, the venv's python3 kernel): it trains with
the Lightning callback, shows the GUI inline, the dashboard as an image and a statistic over
steps as a plotly figure; the served page answers on 127.0.0.1 while the kernel lives and
stops answering after notebook.stop()."""

from __future__ import annotations

import base64
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
        plot = next(o["data"]["application/vnd.plotly.v1+json"] for o in cells[3].outputs
                    if "application/vnd.plotly.v1+json" in o.get("data", {}))
        x = plot["data"][0]["x"]  # plotly encodes small int arrays as base64 int8
        steps = list(base64.b64decode(x["bdata"])) if isinstance(x, dict) else x
        assert steps == [0, 5, 10, 15]  # the gradient's norm at the recorded steps
        client.execute_cell(cells[-1], nb.cells.index(cells[-1]))
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url, timeout=5)
    with deepscope.open_run(tmp_path / "runs" / "notebook") as run:
        assert run.kpis("loss").step.tolist() == list(range(20))
        assert run.kpis("accuracy").step.tolist() == list(range(20))


def test_history_of_a_kpi_and_an_unknown_name(tmp_path):
    pytest.importorskip("plotly")
    import torch

    import deepscope.notebook
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        scope.watch(torch.nn.Linear(2, 1))
        for step in range(3):
            with scope.step(step) as rec:
                rec.kpi("lr", 0.1 * step)
    fig = deepscope.notebook.history(tmp_path / "r", "lr")
    assert list(fig.data[0].y) == pytest.approx([0.0, 0.1, 0.2])
    fig = deepscope.notebook.history(tmp_path / "r", "weight", "max")
    assert list(fig.data[0].x) == [0, 1, 2]
    with pytest.raises(ValueError, match="no KPI 'wieght' and no forward records of a tensor "
                                         "'wieght'; tensors: bias, weight"):
        deepscope.notebook.history(tmp_path / "r", "wieght")
