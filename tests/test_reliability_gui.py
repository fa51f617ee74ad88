"""The GUI on hostile ground: it serves a crashed run, listens on 127.0.0.1 only unless told
otherwise, and no URL or run name reaches a file outside what it serves."""

from __future__ import annotations

import pytest

pytest.importorskip("dash")

from deepscope.cli.main import build_parser  # noqa: E402
from deepscope.gui.app import create_app  # noqa: E402
from deepscope.gui.data import ProjectData  # noqa: E402
from deepscope.gui.server import make_server  # noqa: E402
from tests.stress import workload  # noqa: E402


@pytest.fixture(scope="module")
def crashed_project(tmp_path_factory):
    """A project folder whose one run was frozen as a kill -9 leaves it (WAL, no checkpoint),
    next to a run-looking folder outside it."""
    root = tmp_path_factory.mktemp("gui")
    (root / "outside").mkdir()
    (root / "outside" / "rank0.sqlite").write_bytes(b"")
    return workload.crashed_copy(root).parent


@pytest.fixture(scope="module")
def client(crashed_project):
    return create_app(crashed_project).server.test_client()


def test_serves_a_crashed_run(crashed_project, client):
    assert client.get("/").status_code == 200
    layout = client.get("/_dash-layout")
    assert layout.status_code == 200 and b'"live"' in layout.data
    with ProjectData(crashed_project).run("live").reading() as run:  # the GUI's reader
        workload.check_steps(run, 0, [0])


def test_binds_loopback_by_default(tmp_path):
    assert build_parser().parse_args(["serve", str(tmp_path)]).host == "127.0.0.1"
    server = make_server(tmp_path, port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()


@pytest.mark.parametrize("url", [
    "/assets/../../../../../../etc/passwd", "/assets/..%2f..%2f..%2f..%2fetc%2fpasswd",
    "/assets/%2e%2e/data.py", "/assets/%2e%2e%2fdata.py", "/../../../../etc/passwd",
    "/_dash-component-suites/dash/..%2f..%2f..%2f..%2f..%2fetc%2fpasswd",
    "/_dash-component-suites/..%2fdeepscope/gui/data.py",
])
def test_path_tricks_in_urls_serve_no_file(client, url):
    response = client.get(url)
    # Refused (404; Dash answers 500 for component paths it does not know) or, for a page
    # route, the app's own page: never the file's content.
    assert response.status_code in (200, 404, 500)
    assert b"root:" not in response.data and b"class ProjectData" not in response.data


@pytest.mark.parametrize("name", ["../outside", "..", "live/../live", "/etc", "live/."])
def test_path_tricks_in_run_names_are_refused(crashed_project, name):
    with pytest.raises(ValueError, match="no run"):
        ProjectData(crashed_project).run(name)
