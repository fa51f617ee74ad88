"""Reading a run never loads what writes one: the layers below the query API stay light.

Plain `import torch` (2.13) already imports `torch.func` / `torch._functorch.apis`, so "no
torch.func" is checked in its strong, falsifiable form: these imports load no torch at all,
and no deepscope recorder or instruments module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
_FORBIDDEN = ("torch", "deepscope.instruments", "deepscope.recorder")


def _loaded_after(code: str) -> list[str]:
    """Module names in sys.modules after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": SRC}, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _forbidden(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in _FORBIDDEN)]


@pytest.mark.parametrize("code", [
    "import deepscope.query",
    "import deepscope; deepscope.open_run",
    "import deepscope.gui.app",
    # what `deepscope serve` loads before the server starts: every verb, the server module
    "from deepscope.cli.main import build_parser; build_parser().parse_args(['serve', '.'])\n"
    "import deepscope.gui.server",
    "import deepscope.anomalies, deepscope.demo",  # lazy packages: their heavy names on use
])
def test_reading_loads_no_torch_and_no_instruments(code: str) -> None:
    assert _forbidden(_loaded_after(code)) == []


def test_the_criterion_can_fail() -> None:
    """The same probe sees torch.func under plain torch, and the recorder's own imports."""
    assert "torch.func" in _loaded_after("import torch")
    recorder = _loaded_after("import deepscope; deepscope.Scope")
    assert "torch" in recorder and "deepscope.recorder.scope" in recorder
    # the per-sample engine loads only for a Scope with instruments
    assert not [m for m in recorder if m.startswith("deepscope.instruments")]
