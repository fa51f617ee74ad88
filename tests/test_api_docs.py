"""docs/api.md is generated from the docstrings and must match them."""

import importlib.util
from pathlib import Path

import deepscope

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "tools" / "gen_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_api_reference_is_current():
    text = _tool().render()
    assert (ROOT / "docs" / "api.md").read_text() == text, "run: python tools/gen_api.py"


def test_every_public_name_has_a_docstring():
    missing = [n for n in deepscope.__all__
               if not n.startswith("_") and callable(getattr(deepscope, n))
               and not (getattr(deepscope, n).__doc__ or "").strip()]
    assert missing == []


def test_reference_shows_annotations_as_written_and_documents_every_member():
    text = _tool().render()
    assert "'None'" not in text and "-> 'pd.DataFrame'" not in text
    assert "## `deepscope.Run(path: str | Path)`" in text  # a class: no "-> None"
    assert "(no docstring)" not in text
