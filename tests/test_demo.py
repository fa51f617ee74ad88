"""The demo end to end: `deepscope demo --no-serve` records a bugged and a fixed run in which
the bug (leaky ReLU on the last layers) is visible in the stored data."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import deepscope
from deepscope.cli.main import main
from deepscope.demo import serve_demo
from deepscope.demo.train import _instrument_config

STEPS = 300


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "project"
    assert main(["demo", str(path), "--steps", str(STEPS), "--no-serve"]) == 0
    return path


def _pre_sigmoid_ratio(run: deepscope.Run) -> float:
    """Mean positive over mean |negative| value of the logits, over every stored sample of
    every recorded step and iteration."""
    steps = run.step_table()
    values = [run.values("out.pre_sigmoid", step, view="samples", iteration=it).ravel()
              for step, n in zip(steps["step"], steps["iterations"]) for it in range(n)]
    v = np.concatenate(values)
    assert (v > 0).sum() > 20 and (v < 0).sum() > 20
    return float(v[v > 0].mean() / np.abs(v[v < 0]).mean())


def test_bug_visible_in_pre_sigmoid_values(demo: Path) -> None:
    with deepscope.open_run(demo / "bugged") as bugged, deepscope.open_run(demo / "fixed") as fixed:
        ratio_bugged, ratio_fixed = _pre_sigmoid_ratio(bugged), _pre_sigmoid_ratio(fixed)
    assert ratio_bugged >= 10 * ratio_fixed, (ratio_bugged, ratio_fixed)
    assert 0.3 < ratio_fixed < 3  # without the bug the logits are about symmetric


def test_fixed_run_trains_faster(demo: Path) -> None:
    losses = {}
    for name in ("bugged", "fixed"):
        with deepscope.open_run(demo / name) as run:
            kpis = run.kpis("loss")
            assert list(kpis["step"]) == list(range(STEPS))  # logged on every step
            assert kpis["value"].notna().all()
            losses[name] = kpis["value"].to_numpy()
    # Same data and initial weights in both runs: the last step sees the same batch.
    assert losses["fixed"][-1] < losses["bugged"][-1]
    tail = STEPS // 5
    assert losses["fixed"][-tail:].mean() < losses["bugged"][-tail:].mean() - 0.05


def test_recording_has_kinds_iterations_graph_and_notes(demo: Path) -> None:
    with deepscope.open_run(demo / "bugged") as run:
        steps = run.step_table()
        assert set(run.kinds()) == {"len_01", "len_02", "len_04", "len_06", "len_08"}
        # One iteration per sequence element; every kind recorded, but few steps in all.
        assert (steps["iterations"] == steps["kind"].str[4:].astype(int)).all()
        assert set(steps["kind"]) == set(run.kinds()) and len(steps) <= STEPS // 4
        names = set(run.tensors()["name"])
        assert {"input", "target", "partial_sum", "initial_memory", "memory.out",
                "out.pre_sigmoid", "output", "loss_per_sample", "out.fc2.weight"} <= names
        step = int(steps[steps["kind"] == "len_04"]["step"].iloc[-1])
        graph = run.graph(step, iteration=3)
        edges = {(e["source"], e["target"], e["lag"]) for e in graph["edges"]}
        assert ("memory.out", "pre.hidden", 1) in edges  # the recurrence, one iteration back
        assert ("out.pre_sigmoid", "loss_per_sample", 0) in edges
        assert ("target", "loss_per_sample", 0) in edges
        assert run.values("loss_per_sample", step, view="samples", iteration=3).shape == (4,)
        assert any("the bug" in text for text in run.notes()["text"])
        assert set(run.kpis()["name"]) == {"loss", "accuracy", "learning_rate"}


@pytest.mark.skipif(importlib.util.find_spec("deepscope.instruments.suite") is None,
                    reason="instrument suite not built yet")
def test_instruments_recorded(demo: Path) -> None:
    with deepscope.open_run(demo / "fixed") as run:
        q = run.quantities()
    assert {"Alpha", "GradNorm", "NormTest", "InnerTest", "HessMaxEV", "HessTrace"} <= set(
        q["name"])
    whole = q[(q["layer"] == "") & (q["name"] == "GradNorm")]
    # About 30 evenly spaced points (one step in 10), every one a positive number.
    assert whole["step"].diff().dropna().eq(10).all() and len(whole) == STEPS // 10
    assert (whole["value"] > 0).all()


def test_serve_uses_gui_or_prints_the_command(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    calls = []
    gui = types.ModuleType("deepscope.gui")
    gui.serve = lambda path, host, port: calls.append((Path(path), host, port))  # type: ignore
    monkeypatch.setitem(sys.modules, "deepscope.gui", gui)
    serve_demo(tmp_path, port=8123)
    assert calls == [(tmp_path, "127.0.0.1", 8123)]
    monkeypatch.setitem(sys.modules, "deepscope.gui", None)  # the GUI cannot be imported
    serve_demo(tmp_path, port=8123)
    assert f"deepscope serve {tmp_path} --port 8123" in capsys.readouterr().out


def test_without_instrument_suite_it_warns_and_records_without(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepscope.instruments.suite", None)
    with pytest.warns(RuntimeWarning, match="instruments unavailable.*recording without"):
        assert _instrument_config("economy") is None


def test_bad_steps_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", str(tmp_path), "--steps", "0", "--no-serve"]) == 2
    err = capsys.readouterr().err
    assert "steps must be an integer >= 10" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing recorded


def test_doctor_names_the_tutorial_bug(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with deepscope.open_run(demo / "bugged") as bugged, deepscope.open_run(demo / "fixed") as fixed:
        found, clean = bugged.diagnoses(), fixed.diagnoses()
    assert list(found.columns[:4]) == ["code", "confidence", "step", "where"]
    assert (found.iloc[0]["code"], found.iloc[0]["where"]) == ("saturation", "out.pre_sigmoid")
    assert found.iloc[0]["evidence"]["side_ratio"] < 0.05
    assert clean.empty, clean[["code", "where", "summary"]].to_string()
    assert main(["doctor", str(demo / "bugged")]) == 0
    out = capsys.readouterr().out
    assert "1. saturation" in out and "out.pre_sigmoid" in out
    assert out.index("DIAGNOSIS") < out.index("finding")  # low-level findings stay below
