"""`deepscope serve` checks what it is given before serving (issue 21, item 3)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from deepscope.cli.main import build_parser, main


def test_missing_folder_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", str(tmp_path / "does" / "not" / "exist")]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and "\n" not in err


def test_taken_port_is_one_line_error_naming_the_option(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"port {port}" in err and "--port" in err and "\n" not in err


def test_help_does_not_promise_to_open_a_browser() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "http://127.0.0.1:8050" in help_text
    assert "in the browser" not in help_text
