"""`import deepscope` imports no framework; a missing extra is one line naming pip."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "IPython", "nbclient")


def test_import_deepscope_imports_no_framework():
    code = ("import sys, deepscope, deepscope.integrations; "
            f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("module, framework, extra", [
    ("deepscope.integrations.lightning", "lightning", "lightning"),
    ("deepscope.integrations.pytorch_lightning", "pytorch_lightning", "lightning"),
    ("deepscope.integrations.transformers", "transformers", "transformers")])
def test_missing_extra_names_the_pip_command(monkeypatch, module, framework, extra):
    monkeypatch.setitem(sys.modules, framework, None)  # makes `import framework` fail
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as err:
        importlib.import_module(module)
    assert str(err.value) == (f"this needs the {framework} package: "
                              f"pip install 'deepscope[{extra}]'")


def test_notebook_without_ipython_names_the_pip_command(monkeypatch, tmp_path):
    import deepscope.notebook
    monkeypatch.setitem(sys.modules, "IPython", None)
    monkeypatch.setitem(sys.modules, "IPython.display", None)
    with pytest.raises(ImportError, match=r"pip install 'deepscope\[notebook\]'"):
        deepscope.notebook.show(tmp_path)
