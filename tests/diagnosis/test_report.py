"""Run.diagnoses() and the doctor's diagnosis section: columns, missing evidence said out
loud, a failing check reported rather than swallowed, and the query layer kept light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import deepscope
from deepscope.anomalies.doctor import report
from deepscope.diagnosis import COLUMNS
from tests.helpers import train_mlp

from .zoo import cases, train


def test_default_recording_says_which_evidence_is_missing(tmp_path: Path) -> None:
    scope = deepscope.Scope(tmp_path, run="plain")
    train_mlp(scope, steps=12)
    scope.close()
    with deepscope.open_run(tmp_path / "plain") as run:
        df = run.diagnoses(threshold=0)
    assert list(df.columns) == COLUMNS
    # train_mlp's labels are random: not_learning is the only thing there is to find
    assert set(df["code"]) <= {"not_learning"}
    text = report(tmp_path / "plain")
    # recorded without instruments: these cannot be judged, and the doctor says how to fix it
    assert "missing evidence for noisy_batch: no norm test (instruments); gather it with " \
           "Scope(..., instruments='economy')" in text
    assert "missing_zero_grad: no α and the update size (instruments)" in text
    assert text.index("DIAGNOSIS") < text.index("no anomalies recorded")


def test_diagnoses_frame_ranked_with_evidence(tmp_path: Path) -> None:
    _, bugged, _ = cases()["not_updated"]
    with train(tmp_path, "bug", bugged()) as run:
        df = run.diagnoses()
        every = run.diagnoses(threshold=0)
    assert list(df.columns) == COLUMNS
    assert df["confidence"].is_monotonic_decreasing and (df["confidence"] >= 0.5).all()
    assert set(df["code"]) == {"not_updated"}
    assert set(df["where"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # not 4.*
    assert all(e["recorded_steps"] >= 2 and e["grad_norm_max"] > 0 for e in df["evidence"])
    assert df["step"].dtype == "Int64" and len(every) >= len(df)


def test_a_failing_check_is_reported_not_swallowed(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    scope = deepscope.Scope(tmp_path, run="plain")
    train_mlp(scope, steps=4)
    scope.close()

    def broken(ev: object) -> list:
        raise RuntimeError("boom")

    monkeypatch.setattr("deepscope.diagnosis.not_updated", broken)
    text = report(tmp_path / "plain")
    assert "could not judge not_updated: the check failed (RuntimeError: boom); please " \
           "report it" in text


def test_query_import_stays_light() -> None:
    code = ("import sys, deepscope.query; "
            "print('deepscope.diagnosis' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(Path(deepscope.__file__).parents[1])})
    assert out.stdout.strip() == "False"


