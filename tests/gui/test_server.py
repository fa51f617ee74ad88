"""Serving: local assets only, loopback by default, a warning otherwise, the CLI verb."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deepscope.cli.main import build_parser, main
from deepscope.gui import server
from deepscope.gui.app import create_app


def test_page_and_assets_are_served_locally(project: Path) -> None:
    client = create_app(project).server.test_client()
    html = client.get("/").get_data(as_text=True)
    urls = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert urls and all(u.startswith("/") for u in urls), urls
    for url in urls:                                   # every script and stylesheet is ours
        assert client.get(url).status_code == 200, url
    assert any("/assets/style.css" in u for u in urls)
    assert any("/assets/app.js" in u for u in urls)


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("localhost", True),
                                                ("::1", True), ("0.0.0.0", False),
                                                ("192.168.1.5", False), ("example.org", False)])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert server.is_loopback(host) is loopback


class _FakeServer:
    server_port = 8123

    def serve_forever(self) -> None:
        raise KeyboardInterrupt

    def server_close(self) -> None:
        pass


def test_serve_warns_only_when_binding_beyond_this_machine(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    bound = []
    monkeypatch.setattr(server, "make_server",
                        lambda path, host, port: bound.append((host, port)) or _FakeServer())
    assert main(["serve", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert bound == [("127.0.0.1", 8050)]
    assert "warning" not in out.err and "http://127.0.0.1:8123/" in out.out
    assert main(["serve", str(tmp_path), "--host", "0.0.0.0", "--port", "9000"]) == 0
    out = capsys.readouterr()
    assert bound[-1] == ("0.0.0.0", 9000)
    assert "anyone who can reach this machine" in out.err


def test_serve_is_a_cli_verb() -> None:
    args = build_parser().parse_args(["serve", "runs"])
    assert (args.path, args.host, args.port) == ("runs", "127.0.0.1", 8050)
