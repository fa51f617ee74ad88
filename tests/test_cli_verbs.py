"""The `deepscope` verbs: one explicit, ordered list; a missing optional extra is named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from deepscope.cli import main as cli
from deepscope.cli.verbs import Verb, verb


def test_every_verb_is_listed_in_order(capsys) -> None:
    assert [v.name for v in cli.VERBS] == ["ls", "serve", "demo", "plot", "export", "doctor"]
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listed = capsys.readouterr().out
    positions = [listed.index(f"    {v.name} ") for v in cli.VERBS]
    assert positions == sorted(positions)


def test_a_verb_is_still_a_function() -> None:
    @verb("hello", "say hello", lambda p: None)
    def hello(args: object) -> int:
        return 7

    assert isinstance(hello, Verb) and hello(None) == 7  # type: ignore[arg-type]


def test_a_missing_extra_is_named_in_one_line(monkeypatch, capsys, tmp_path: Path) -> None:
    """export's packages come from the `export` extra: with tensorboard absent, the verb
    still exists and says which extra to install."""
    def needs_pyarrow(args: object) -> int:
        raise ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow")

    export = cli.VERBS[4]
    monkeypatch.setattr(cli, "VERBS", (*cli.VERBS[:4], Verb("export", export.help,
                                                            export.configure, needs_pyarrow,
                                                            export.extra)))
    assert cli.main(["export", str(tmp_path), "--parquet", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("deepscope: error: `deepscope export` needs pyarrow: "
                   "pip install 'deepscope[export]'")


def test_a_missing_deepscope_module_is_a_bug_not_an_extra(monkeypatch, tmp_path) -> None:
    def broken(args: object) -> int:
        raise ModuleNotFoundError("No module named 'deepscope.nope'", name="deepscope.nope")

    export = cli.VERBS[4]
    monkeypatch.setattr(cli, "VERBS", (Verb("export", export.help, export.configure, broken,
                                            export.extra),))
    with pytest.raises(ModuleNotFoundError):
        cli.main(["export", str(tmp_path), "--parquet", str(tmp_path)])


def test_the_serve_extra_is_named_when_dash_is_missing(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "dash", None)  # import dash -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "deepscope.gui.server", raising=False)
    monkeypatch.delitem(sys.modules, "deepscope.gui.app", raising=False)
    assert cli.main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "deepscope[gui]" in err and len(err.strip().splitlines()) == 1
