"""Runs inside Jupyter and VS Code notebooks.

    import deepscope.notebook
    deepscope.notebook.show("runs/baseline")       # the GUI, inline (served in the background)
    deepscope.notebook.dashboard("runs/baseline")  # the static instrument dashboard, an image
    deepscope.notebook.history("runs/baseline", "fc1.weight", "norm", direction="grad")
    deepscope.notebook.stop()                      # stop the background servers

The GUI is served on 127.0.0.1 (a free port) by a thread of the kernel; showing the same
folder again reuses its server. Needs the `notebook` and `gui` extras.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

from .integrations import require
from .query.run import Run

__all__ = ["dashboard", "history", "show", "stop", "url"]

_servers: dict[Path, tuple[Any, threading.Thread]] = {}
_lock = threading.Lock()


def url(path_or_run: str | Path | Run) -> str:
    """The address of the GUI on `path_or_run` (a project folder, a run folder or an open
    `Run`), starting its server in the background if it is not running yet."""
    path = Path(path_or_run.path if isinstance(path_or_run, Run) else path_or_run).resolve()
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder; pass a project folder (of runs) or a run "
                         "folder such as runs/baseline")
    with _lock:
        if path not in _servers:
            try:
                from .gui.server import make_server
            except ModuleNotFoundError as exc:
                raise ImportError(f"the GUI needs {exc.name}: pip install 'deepscope[gui]'"
                                  ) from None
            server = make_server(path, "127.0.0.1", 0)
            thread = threading.Thread(target=server.serve_forever, name="deepscope-notebook",
                                      daemon=True)
            thread.start()
            _servers[path] = (server, thread)
        server = _servers[path][0]
    return f"http://127.0.0.1:{server.server_port}/"


def show(path_or_run: str | Path | Run, height: int = 800) -> None:
    """Display the GUI on `path_or_run` inline (an iframe `height` pixels high)."""
    if isinstance(height, bool) or not isinstance(height, int) or height < 100:
        raise ValueError(f"height must be an integer number of pixels >= 100, got {height!r}")
    display = require("IPython.display", "notebook")
    display.display(display.IFrame(url(path_or_run), width="100%", height=height))


def dashboard(path_or_run: str | Path | Run, step: int | None = None, *, dpi: int = 80,
              log_steps: bool = False) -> None:
    """Display the run's static instrument dashboard (see `deepscope plot`) as a PNG image;
    step: the run as it was at that step (default: all of it)."""
    display = require("IPython.display", "notebook")
    from .dashboard import plot_dashboard

    fig = plot_dashboard(path_or_run, step=step, log_steps=log_steps)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    display.display(display.Image(data=buffer.getvalue(), format="png"))


def history(path_or_run: str | Path | Run, name: str, statistic: str = "mean", *,
            direction: str = "forward", iteration: int = 0) -> Any:
    """A plotly figure of one statistic of tensor `name` over the recorded steps, or of the
    KPI `name` over every step (`statistic` and `direction` are then unused); returned, so
    it displays inline as the cell's value."""
    require("plotly", "notebook")
    import plotly.graph_objects as go

    run = path_or_run if isinstance(path_or_run, Run) else Run(path_or_run)
    try:
        kpis = run.kpis()
        if name in set(kpis["name"]):
            kpi = kpis[kpis["name"] == name]
            x, y, title = kpi.step, kpi.value, f"{run.name}: {name}"
        else:
            try:
                table = run.stats(name, direction=direction, statistic=statistic,
                                  iteration=iteration)
            except KeyError:  # no such tensor: said below, with the tensors there are
                table = ()
            if not len(table):
                tensors = sorted(set(run.tensors().name))
                raise ValueError(f"run {run.name!r} has no KPI {name!r} and no {direction} "
                                 f"records of a tensor {name!r}; tensors: "
                                 f"{', '.join(tensors[:20]) or 'none'}")
            x, y = table.step, table.value
            title = f"{run.name}: {statistic} of {name} ({direction})"
    finally:
        if run is not path_or_run:
            run.close()
    fig = go.Figure(go.Scatter(x=x, y=y, mode="lines+markers", name=name))
    fig.update_layout(title=title, xaxis_title="step", height=360,
                      margin={"l": 50, "r": 20, "t": 50, "b": 40})
    return fig


def stop() -> None:
    """Stop every GUI server `show` started (their iframes stop answering)."""
    with _lock:
        servers = list(_servers.values())
        _servers.clear()
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
