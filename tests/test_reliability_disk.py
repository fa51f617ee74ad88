"""A disk that fills up (or any failing write): one warning, recording stops, training goes on,
and everything committed before stays readable — with no partial step left behind.

A real SQLITE_FULL comes from `PRAGMA max_page_count` on the writer's own connection; a
failure at each single statement of a step's transaction comes from a connection wrapper.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
import torch

import deepscope
from tests.stress import workload


class FailingConnection:
    """The writer's connection, failing its `fail_at`-th statement (1-based) as a full disk
    would; 0 never fails and only counts. ROLLBACK always goes through."""

    def __init__(self, con: sqlite3.Connection, fail_at: int) -> None:
        self._con = con
        self.fail_at = fail_at
        self.count = 0

    def _statement(self, sql: str) -> None:
        if sql != "ROLLBACK":
            self.count += 1
            if self.count == self.fail_at:
                raise sqlite3.OperationalError("database or disk is full")

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        self._statement(sql)
        return self._con.execute(sql, *args)

    def executemany(self, sql: str, rows: object) -> sqlite3.Cursor:
        self._statement(sql)
        return self._con.executemany(sql, rows)

    def __getattr__(self, name: str) -> object:
        return getattr(self._con, name)


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def write_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "recording is disabled" in r.getMessage()]


def assert_committed_steps_intact(run_dir: Path, steps: list[int]) -> None:
    """The run opens, holds exactly `steps`, each whole, and no row of a failed step."""
    with deepscope.open_run(run_dir) as run:
        assert run.steps() == steps
        workload.check_steps(run, 0, steps)
    assert workload.orphan_steps(run_dir / "rank0.sqlite") == {}


def fill_disk(scope: deepscope.Scope) -> None:
    """Cap the database at its current size: the next write that needs a page fails."""
    con = scope.writer._con
    pages = con.execute("PRAGMA page_count").fetchone()[0]
    con.execute(f"PRAGMA max_page_count={pages}")


def test_disk_full_disables_recording_once_and_training_goes_on(tmp_path, caplog):
    scope, model = workload.open_scope(tmp_path, "r")
    for step in range(3):
        workload.train_step(scope, model, 0, step)
    scope.flush()
    fill_disk(scope)
    before = params(model)
    with caplog.at_level(logging.WARNING, logger="deepscope"):
        for step in range(3, 10):
            workload.train_step(scope, model, 0, step)
        # flush() says what is not on disk instead of returning as if all were written
        with pytest.raises(deepscope.RecordingError, match=r"database or disk is full\); "
                           r"nothing recorded after step 2 was written"):
            scope.flush()
        assert_committed_steps_intact(tmp_path / "r", [0, 1, 2])  # readable while it runs
        with scope.step(10) as rec:
            assert not rec.recording  # disabled: later steps cost nothing
        scope.close()
    assert scope.writer.failed
    assert len(write_failures(caplog)) == 1
    assert all(not torch.equal(a, b) for a, b in zip(before, params(model)))  # it trained
    assert_committed_steps_intact(tmp_path / "r", [0, 1, 2])


def test_disk_full_warning_names_the_cause(tmp_path, caplog):
    scope, model = workload.open_scope(tmp_path, "r")
    workload.train_step(scope, model, 0, 0)
    scope.flush()
    fill_disk(scope)
    with caplog.at_level(logging.WARNING, logger="deepscope"):
        for step in range(1, 4):
            workload.train_step(scope, model, 0, step)
        scope.close()
    assert "full" in scope.writer.failed
    assert "full" in write_failures(caplog)[0]


def fail_step_one(root: Path, name: str, fail_at: int) -> tuple[deepscope.Scope, int, bool]:
    """Record steps 0-2 of a run with statement `fail_at` of step 1's writes failing.

    Returns the closed scope, how many statements step 1's writes took (as far as they got)
    and whether training went on after the failure.
    """
    scope, model = workload.open_scope(root, name)
    workload.train_step(scope, model, 0, 0)
    scope.flush()
    con = scope.writer._con = FailingConnection(scope.writer._con, fail_at)
    workload.train_step(scope, model, 0, 1)
    try:
        scope.flush()
        assert fail_at == 0
    except deepscope.RecordingError:
        assert fail_at > 0
    statements = con.count
    before = params(model)
    workload.train_step(scope, model, 0, 2)
    scope.close()
    return scope, statements, not torch.equal(before[0], params(model)[0])


def test_a_failure_at_any_statement_of_a_step_leaves_no_partial_step(tmp_path, caplog):
    """Fail each statement of step 1's writes in turn (its KPI transaction, then every
    statement of its step transaction): always exactly step 0 survives, whole."""
    _, statements, _ = fail_step_one(tmp_path, "count", 0)
    assert statements >= 8  # KPIs: BEGIN, rows, COMMIT; the step: BEGIN, 4+ tables, COMMIT
    for fail_at in range(1, statements + 1):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="deepscope"):
            scope, _, trained = fail_step_one(tmp_path, f"fail{fail_at}", fail_at)
        assert scope.writer.failed == "OperationalError: database or disk is full", fail_at
        assert len(write_failures(caplog)) == 1 and trained
        assert_committed_steps_intact(tmp_path / f"fail{fail_at}", [0])
