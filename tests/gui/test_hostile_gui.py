"""The GUI server against hostile pages, requests and run files: DNS rebinding, huge bodies,
malformed requests, crafted sizes, markup in names (no browser needed)."""

from __future__ import annotations

import logging
import shutil
import socket
import sqlite3
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from werkzeug.test import Client

from deepscope import CorruptRunError
from deepscope.gui import figures, graph_view, http_guard, server
from deepscope.gui.data import LRU, ProjectData, approx_bytes
from deepscope.gui.selection import Request, resolve

from .conftest import start_server


@pytest.fixture(scope="module")
def client(project: Path) -> Client:
    made = server.make_server(project, "127.0.0.1", 0)
    made.server_close()  # only its WSGI application is used
    return Client(made.app)


# --- requests ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("host", "status"), [
    ("127.0.0.1:8050", 200), ("localhost:8050", 200), ("LOCALHOST", 200), ("[::1]:8050", 200),
    ("evil.example:8050", 421), ("127.0.0.1.evil.example", 421), ("", 421)])
def test_only_this_machines_host_names_are_answered(client: Client, host: str,
                                                    status: int) -> None:
    """Before: any Host was answered, so a page whose domain was rebound to 127.0.0.1 could
    read the run list and values."""
    assert client.get("/", headers={"Host": host}).status_code == status


def test_allowed_hosts_follow_the_bound_address() -> None:
    assert server.allowed_hosts("127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert server.allowed_hosts("192.168.1.5") == {"192.168.1.5"}
    assert server.allowed_hosts("0.0.0.0") is None and server.allowed_hosts("::") is None


def test_request_bodies_over_the_cap_are_refused_unread(client: Client) -> None:
    """Before: four 200 MB POSTs left the server at 2.3 GB."""
    body = b"x" * (http_guard.MAX_REQUEST_BYTES + 1)
    reply = client.post("/_dash-update-component", data=body,
                        headers={"Host": "127.0.0.1", "Content-Type": "application/json"})
    assert reply.status_code == 413


def test_a_malformed_callback_request_logs_one_line(client: Client,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Before: Flask logged the full traceback of Dash's KeyError."""
    with caplog.at_level(logging.WARNING):
        reply = client.post("/_dash-update-component", json={"output": 5},
                            headers={"Host": "127.0.0.1"})
    assert reply.status_code == 500
    records = [r for r in caplog.records if "request failed" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is None
    assert "\n" not in records[0].getMessage()


def test_a_malformed_http_request_logs_one_line(project: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    url, live = start_server(project)
    try:
        with caplog.at_level(logging.WARNING), socket.create_connection(
                ("127.0.0.1", int(url.rsplit(":", 1)[1].strip("/")))) as s:
            s.sendall(b"GET /\x1b[2J HTTP/9\r\n\r\n")
            assert b"Error response" in s.recv(200)  # HTTP/0.9-style: the body only
            for _ in range(50):  # the handler thread logs after replying
                if any("bad request" in r.getMessage() for r in caplog.records):
                    break
                time.sleep(0.02)
    finally:
        live.shutdown()
        live.server_close()
    lines = [r.getMessage() for r in caplog.records if "bad request" in r.getMessage()]
    assert len(lines) == 1 and lines[0].isprintable(), lines


# --- crafted sizes reach the GUI as one-line errors -------------------------------------------
def crafted_copy(project: Path, tmp_path: Path, *sql: str) -> ProjectData:
    """A project holding a copy of run `base` edited by `sql`."""
    run = tmp_path / "runs" / "base"
    shutil.copytree(project / "base", run)
    con = sqlite3.connect(run / "rank0.sqlite")
    for statement in sql:
        con.execute(statement)
    con.commit()
    con.close()
    return ProjectData(run.parent)


@pytest.mark.parametrize(("sql", "field"), [
    ("UPDATE steps SET iterations = 3000000", "steps.iterations is 3000000"),
    ("UPDATE steps SET iterations = 1e999", "steps.iterations holds inf"),
    ("UPDATE tensors SET shape = '[1000000000000, 3]'", "tensors.shape holds"),
    ("UPDATE meta SET value = '1000000000000' WHERE key = 'max_samples'",
     "meta max_samples is 1000000000000"),
])
def test_crafted_sizes_stop_the_selection_in_one_line(project: Path, tmp_path: Path, sql: str,
                                                      field: str) -> None:
    """Before: 3e6 iterations took the GUI 14-32 s and +1.4 GB (a dropdown of 3e6 options),
    1e12 grew until MemoryError; a [1e12, 3] shape did the same through the sample list."""
    data = crafted_copy(project, tmp_path, sql)
    with pytest.raises(CorruptRunError, match=field):
        resolve(data, Request(), None)


def test_caches_are_bounded_in_bytes() -> None:
    """Before: items were counted, not measured (729 MB kept after a bomb)."""
    frame = pd.DataFrame({"x": np.zeros(1000)})
    size = approx_bytes(frame)
    cache = LRU(100, max_bytes=3 * size)
    for key in range(5):
        cache.get(key, lambda: frame.copy())
    assert list(cache._items) == [2, 3, 4] and cache._bytes == 3 * size
    big = pd.DataFrame({"x": np.zeros(10_000)})
    assert cache.get("big", lambda: big) is big and "big" not in cache._items
    assert approx_bytes({"a": [np.zeros(100), "text"]}) > 800


def test_at_most_max_open_runs_stay_open(project: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    from deepscope.gui import data as gui_data
    monkeypatch.setattr(gui_data, "MAX_OPEN_RUNS", 2)
    data = ProjectData(project)
    first = data.run("base")
    first.step_index()
    data.run("other")
    data.run("recurrent")
    assert list(data._runs) == ["other", "recurrent"] and first.run._readers == {}
    assert first.run.steps()  # a request still holding it reads on (the reader reopens)


def test_too_many_values_are_named_not_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(figures, "MAX_DRAWN_VALUES", 100)
    assert figures.values_figure(np.zeros(100), "t")["data"]
    fig = figures.values_figure(np.zeros((11, 10)), "t")
    assert fig["data"] == [] and "110 values (11x10)" in fig["layout"]["annotations"][0]["text"]


def test_lag0_cycles_lay_out_in_linear_time() -> None:
    """Before: each cycle broken rescanned every node (40k nodes in 2-cycles: 25-51 s per
    update, 7.8 s for 20k); every node still gets a place, each pair in adjacent layers."""
    n = 2000
    tensors = [{"name": f"t{i}", "role": "activation", "node": f"t{i}"} for i in range(n)]
    edges = [e for i in range(0, n, 2) for e in (
        {"source": f"t{i}", "target": f"t{i + 1}", "lag": 0},
        {"source": f"t{i + 1}", "target": f"t{i}", "lag": 0})]
    nodes = [{"id": t["name"], "role": "activation", "tensors": [t["name"]]} for t in tensors]
    layout = graph_view.build_layout({"tensors": tensors, "edges": edges, "nodes": nodes})
    assert len(layout.positions) == n
    assert all(abs(layout.positions[f"t{i}"][0] - layout.positions[f"t{i + 1}"][0])
               == graph_view.X_GAP for i in range(0, n, 2))


# --- names are text, never markup -------------------------------------------------------------
MARKUP = '<b>x</b><a href="https://evil.example">click</a>&amp;'
ESCAPED = ("&lt;b&gt;x&lt;/b&gt;&lt;a href=\"https://evil.example\"&gt;click&lt;/a&gt;"
           "&amp;amp;")


def test_names_reach_plotly_as_text() -> None:
    """Before: a KPI or layer named <b>..</b> or <a href=..> rendered bold or clickable."""
    assert figures.base_layout(MARKUP)["title"]["text"] == ESCAPED
    trace = figures.line_trace(MARKUP, [0, 1], [1.0, 2.0])
    assert trace["name"] == ESCAPED and ESCAPED in trace["hovertemplate"]
    assert "<b>" not in trace["hovertemplate"].replace("<br>", "")
    assert figures.message_figure(MARKUP)["layout"]["annotations"][0]["text"] == ESCAPED
    assert figures.note(MARKUP)["text"] == ESCAPED
