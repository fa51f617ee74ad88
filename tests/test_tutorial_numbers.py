"""The demo is deterministic, and the numbers docs/tutorial.md quotes are what the full demo
records (issue 21, item 8). The full demo takes a minute or more: marked slow."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import deepscope
from deepscope.demo import run_demo

TUTORIAL = (Path(__file__).resolve().parent.parent / "docs" / "tutorial.md").read_text()


def _stat(run: deepscope.Run, tensor: str, statistic: str, step: int, iteration: int) -> float:
    rows = run.stats_wide(tensor, direction="forward", step=step, iteration=iteration)
    return float(rows[statistic].iloc[0])


def test_two_recordings_are_identical(tmp_path: Path) -> None:
    a = run_demo(tmp_path / "a", steps=40, progress=False)
    b = run_demo(tmp_path / "b", steps=40, progress=False)
    assert a["tail_loss"] == b["tail_loss"] and a["final_loss"] == b["final_loss"]
    for name in a["runs"]:
        with deepscope.open_run(a["runs"][name]) as ra, deepscope.open_run(b["runs"][name]) as rb:
            assert ra.kpis().equals(rb.kpis())
            assert ra.stats_wide().equals(rb.stats_wide())
            qa, qb = ra.quantities(), rb.quantities()
            np.testing.assert_array_equal(qa["value"], qb["value"])  # NaN where missing
            step = ra.steps()[-1]
            np.testing.assert_array_equal(ra.values("out.pre_sigmoid", step, view="samples"),
                                          rb.values("out.pre_sigmoid", step, view="samples"))


def _quoted(pattern: str) -> float:
    """A number the tutorial quotes (its unicode minus read as '-')."""
    found = re.search(pattern, TUTORIAL)
    assert found, pattern
    return float(found.group(1).replace("−", "-"))


@pytest.mark.slow
def test_the_tutorial_quotes_what_the_full_demo_records(tmp_path: Path) -> None:
    result = run_demo(tmp_path / "deepscope-demo", progress=False)
    for name in ("bugged", "fixed"):
        loss = _quoted(rf"{name}\s+loss over the last 10% of steps ([\d.]+)")
        accuracy = _quoted(rf"{name}\s+loss over the last 10% of steps [\d.]+, accuracy ([\d.]+)%")
        assert f"{result['tail_loss'][name]:.3f}" == f"{loss:.3f}"
        assert f"{result['tail_accuracy'][name]:.1%}" == f"{accuracy:.1f}%"
    size = _quoted(r"in … s, ([\d.]+) MB on disk")
    assert result["size_bytes"] / 1e6 == pytest.approx(size, rel=0.1)
    with deepscope.open_run(result["runs"]["bugged"]) as run:
        step = run.steps("len_08")[-1]  # the tutorial's view: the latest len_08 step
        assert _stat(run, "output", "min", step, 7) == pytest.approx(
            _quoted(r"\(([\d.]+) in the full demo\)"), abs=0.005)
        assert _stat(run, "out.pre_sigmoid", "max", step, 7) == pytest.approx(
            _quoted(r"The \*\*max\*\* is about ([\d.]+)"), abs=0.05)
        assert _stat(run, "out.pre_sigmoid", "min", step, 7) == pytest.approx(
            _quoted(r"the \*\*min\*\* only about (−?[\d.]+)"), abs=0.005)
        assert _stat(run, "memory.out", "min", step, 7) == pytest.approx(
            _quoted(r"`memory.out` has min (−?[\d.]+)"), abs=0.005)
        assert _stat(run, "memory.out", "max", step, 7) == pytest.approx(
            _quoted(r"`memory.out` has min −?[\d.]+ and max ([\d.]+)"), abs=0.05)
