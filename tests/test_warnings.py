"""Recording warnings reach the user: one Python warning each, stored in the run, read by
`Run.warnings()`, printed by `deepscope doctor` (the GUI piece: tests/gui)."""

from __future__ import annotations

import sqlite3
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import deepscope
from deepscope.anomalies.doctor import report
from deepscope.errors import CorruptRunError, DeepscopeWarning

BN_MESSAGE = "in train mode"


def batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def record(path: Path, model: nn.Module, steps: int = 3, skip_loss: tuple[int, ...] = (),
           instruments: str | list[str] = "economy", **scope_args) -> list[warnings.WarningMessage]:
    """Train `steps` instrumented steps; returns the Python warnings deepscope emitted."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with deepscope.Scope(path, "r", instruments=instruments, schedule=1,
                             **scope_args) as scope:
            scope.watch(model, optimizer=opt)
            for step in range(steps):
                with scope.step(step) as rec:
                    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
                    losses = F.cross_entropy(model(x), y, reduction="none")
                    if step not in skip_loss:
                        rec.loss(losses.mean(), per_sample=losses)
                    opt.zero_grad()
                    losses.mean().backward()
                    opt.step()
    return [w for w in caught if issubclass(w.category, DeepscopeWarning)]


def test_an_instrument_warning_is_warned_once_stored_and_read(tmp_path: Path) -> None:
    caught = record(tmp_path, batchnorm_model(), steps=3)
    bn = [w for w in caught if BN_MESSAGE in str(w.message)]
    assert len(bn) == 1, [str(w.message) for w in caught]  # three steps, one warning
    assert str(bn[0].message).startswith("deepscope: BatchNorm1d '1': in train mode")
    assert bn[0].filename == __file__  # points at the user's `with scope.step(...)`
    with deepscope.open_run(tmp_path / "r") as run:
        table = run.warnings()
    assert list(table.columns) == ["step", "location", "quantities", "message"]
    row = table[table["message"].str.contains(BN_MESSAGE)]
    assert len(row) == 1
    assert row["step"].iloc[0] == 0 and row["location"].iloc[0] == "BatchNorm1d '1'"
    affected = row["quantities"].iloc[0]
    assert {"GradNorm", "NormTest", "GradHist1d"} <= set(affected)
    assert "Distance" not in affected  # needs no per-sample gradient


def test_instruments_without_rec_loss_warn_once_at_the_first_such_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    caught = record(tmp_path, model, steps=4, skip_loss=(1, 2))
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1 and "no rec.loss(...)" in texts[0], texts
    with deepscope.open_run(tmp_path / "r") as run:
        table = run.warnings()
        assert table["step"].tolist() == [1]
        assert "GradNorm" in table["quantities"].iloc[0]
        assert "Distance" not in table["quantities"].iloc[0]
        # the values themselves still say why they are missing
        grad = run.quantities("GradNorm", layer="")
        assert grad.set_index("step")["value"].isna().tolist() == [False, True, True, False]


def test_a_clean_run_has_no_warnings(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    assert record(tmp_path, model, steps=2) == []
    with deepscope.open_run(tmp_path / "r") as run:
        assert run.warnings().empty
    assert "RECORDING WARNINGS" not in report(tmp_path / "r")


def test_runs_recorded_before_the_warnings_table_still_open(tmp_path: Path) -> None:
    torch.manual_seed(0)
    record(tmp_path, batchnorm_model(), steps=1)
    con = sqlite3.connect(tmp_path / "r" / "rank0.sqlite")
    con.execute("DROP TABLE warnings")  # what a file of the same schema version, older, holds
    con.commit()
    con.close()
    with deepscope.open_run(tmp_path / "r") as run:
        assert run.warnings().empty
        assert list(run.warnings().columns) == ["step", "location", "quantities", "message"]
        assert not run.quantities("GradNorm").empty
    assert "no anomalies recorded" in report(tmp_path / "r")
    # resuming such a run adds the table
    record(tmp_path, batchnorm_model(), steps=0, resume=True)
    with deepscope.open_run(tmp_path / "r") as run:
        assert run.warnings().empty


def test_a_crafted_warnings_table_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    record(tmp_path, batchnorm_model(), steps=1)
    con = sqlite3.connect(tmp_path / "r" / "rank0.sqlite")
    con.execute("DROP TABLE warnings")
    con.execute("CREATE VIEW warnings AS SELECT 1 AS step, '' AS location, '[]' AS quantities, "
                "'x' AS message, 1 AS id")
    con.commit()
    con.close()
    with pytest.raises(CorruptRunError, match="table 'warnings' is a view"):
        deepscope.open_run(tmp_path / "r").warnings()


def test_a_warning_message_stored_as_bytes_is_refused_in_one_line(tmp_path: Path) -> None:
    torch.manual_seed(0)
    record(tmp_path, batchnorm_model(), steps=1)
    con = sqlite3.connect(tmp_path / "r" / "rank0.sqlite")
    con.execute("UPDATE warnings SET message = x'1b5b324a'")  # a BLOB: ESC[2J
    con.commit()
    con.close()
    with pytest.raises(CorruptRunError, match="warnings.message") as info:
        deepscope.open_run(tmp_path / "r").warnings()
    assert "\n" not in str(info.value)


def test_a_resumed_run_stores_each_warning_once(tmp_path: Path) -> None:
    model = batchnorm_model()
    record(tmp_path, model, steps=2)
    again = record(tmp_path, model, steps=0, resume=True)
    assert again == []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with deepscope.Scope(tmp_path, "r", instruments="economy", schedule=1,
                             resume=True) as scope:
            scope.watch(model, optimizer=opt)
            with scope.step(5) as rec:
                losses = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)),
                                         reduction="none")
                rec.loss(losses.mean(), per_sample=losses)
                losses.mean().backward()
    assert any(BN_MESSAGE in str(w.message) for w in caught)  # a new process warns again
    with deepscope.open_run(tmp_path / "r") as run:
        table = run.warnings()
    assert table["message"].str.contains(BN_MESSAGE).sum() == 1  # but the run holds it once


def test_doctor_prints_the_warnings(tmp_path: Path) -> None:
    record(tmp_path, batchnorm_model(), steps=2)
    text = report(tmp_path / "r")
    assert "RECORDING WARNINGS (1)" in text
    assert "BatchNorm1d '1': in train mode" in text
    assert "affects: GradNorm" in text


def test_warnings_as_errors_neither_stop_training_nor_lose_the_record(tmp_path: Path) -> None:
    model = batchnorm_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepscopeWarning)
        with deepscope.Scope(tmp_path, "r", instruments="economy", schedule=1) as scope:
            scope.watch(model, optimizer=opt)
            for step in range(2):
                with scope.step(step) as rec:
                    losses = F.cross_entropy(model(torch.randn(8, 4)),
                                             torch.randint(0, 3, (8,)), reduction="none")
                    rec.loss(losses.mean(), per_sample=losses)
                    losses.mean().backward()
    with deepscope.open_run(tmp_path / "r") as run:
        assert run.warnings()["message"].str.contains(BN_MESSAGE).sum() == 1
        assert sorted(run.quantities("GradNorm", layer="")["step"]) == [0, 1]
