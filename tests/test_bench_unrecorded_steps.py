"""`benchmarks/unrecorded_steps.py --breakdown`: the `Scope()` defaults arm's cost by step
position, computed right (no timing is asserted: the numbers of so short a run mean nothing)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports workload.py beside it
    spec = importlib.util.spec_from_file_location("unrecorded_steps",
                                                  ROOT / "benchmarks" / "unrecorded_steps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        sys.modules.pop("workload", None)


def test_breakdown_ratios_and_shares(bench) -> None:
    # plain 2 ms; the recorded step 5 ms (+1.5), the 4 after it 3 ms (+0.5 each, +2 together),
    # the other 5 2.1 ms (+0.05 each, +0.25 together): overhead 3.75 plain steps per cycle
    by_position = [[5e-3, 5e-3]] + [[3e-3]] * 4 + [[2.1e-3, 2.1e-3]] * 5
    text = bench.breakdown(by_position, 2e-3)
    assert "recorded 2.50, the 4 after it 1.50 1.50 1.50 1.50, the other 5 1.050" in text
    shares = dict(re.findall(r"(recorded step|the 4 after it|the other 5) (\d+)%", text))
    assert shares == {"recorded step": "40", "the 4 after it": "53", "the other 5": "7"}


def test_breakdown_printed_by_a_short_run(bench, capsys) -> None:
    bench.main(["--blocks", "2", "--block", "10", "--breakdown"])
    out = capsys.readouterr().out
    assert "Scope() defaults (target ≤ 1.15):" in out
    line = next(s for s in out.splitlines() if s.startswith("Scope() defaults, training-thread"))
    ratios = re.findall(r"\d+\.\d+", line.split("share")[0])
    assert len(ratios) == 6  # the recorded step, the 4 after it, the other 5's mean
