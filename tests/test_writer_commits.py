"""What one recorded step costs the writer: one commit, its KPIs in it; checkpoints on a
thread of their own; KPIs never lost when the step itself is not written."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
import torch

import deepscope
from deepscope.store import writer as writer_module
from deepscope.store.writer import StepPayload, StoreWriter


def record(scope: deepscope.Scope, steps: range) -> None:
    for step in steps:
        with scope.step(step) as rec:
            rec.tensor("x", torch.full((2, 3), float(step)), role="input")
            rec.kpi("k", float(step))


def test_a_recorded_step_commits_its_kpis_in_its_own_transaction(tmp_path, monkeypatch):
    """Steps 0 and 2 recorded, 1 not: two transactions in all, each step's with the KPIs
    logged since the previous commit (step 1's go with step 2)."""
    items = []
    transaction = StoreWriter._transaction

    def counting(self: StoreWriter, pairs: list) -> None:
        items.extend(item for item, _ in pairs)
        transaction(self, pairs)

    with deepscope.Scope(tmp_path, "r", schedule=2) as scope:
        scope.flush()  # the Scope's own start-up items are not counted
        monkeypatch.setattr(StoreWriter, "_transaction", counting)
        record(scope, range(3))
        scope.flush()
        written = list(items)
    assert [type(i).__name__ for i in written] == ["StepPayload", "StepPayload"]
    assert [[(n, s) for n, s, _, _ in i.kpis] for i in written] == [[("k", 0)],
                                                                  [("k", 1), ("k", 2)]]
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0, 2]
    kpis = run.kpis("k")
    assert list(kpis["step"]) == [0, 1, 2] and list(kpis["value"]) == [0.0, 1.0, 2.0]


def test_a_dropped_step_keeps_its_kpis(tmp_path, monkeypatch):
    """on_full='drop' with a full queue loses the step's data, not the KPIs it carried."""
    with deepscope.Scope(tmp_path, "r", schedule=1, on_full="drop") as scope:
        record(scope, range(1))
        monkeypatch.setattr(scope.writer, "submit_step", lambda payload: False)
        record(scope, range(1, 3))
        monkeypatch.undo()
        record(scope, range(3, 4))
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0, 3]
    assert list(run.kpis("k")["step"]) == [0, 1, 2, 3]


def test_kpis_of_a_step_that_fails_to_write_are_committed_alone(tmp_path, monkeypatch):
    """A step whose own data cannot be written (here: its step number exists already) is
    skipped; the KPIs it carried get their own commit. Other failures: see
    test_reliability_writer.test_a_failure_of_one_step_skips_that_step_not_the_run."""
    monkeypatch.setattr(writer_module, "LOCK_WAIT_SECONDS", 0.0)
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        record(scope, range(2))
        scope.flush()
        scope._last_step = None  # pretend another writer's step counter
        with scope.step(1) as rec:
            rec.tensor("x", torch.zeros(2, 3), role="input")
            rec.kpi("k2", 7.0)
        try:
            scope.flush()
        except deepscope.RecordingError as exc:
            assert "step 1 skipped" in str(exc)
        else:
            raise AssertionError("the duplicate step was not reported")
    kpis = deepscope.open_run(tmp_path / "r").kpis("k2")
    assert list(kpis["step"]) == [1] and list(kpis["value"]) == [7.0]


def test_checkpoints_run_beside_the_writer_not_in_its_commits(tmp_path, monkeypatch):
    """The writer's commits leave the WAL to the checkpointer thread (SQLite's own automatic
    checkpoint only past WAL_LIMIT_PAGES): what it checkpointed is in the database file
    itself, readable without the WAL; close() still leaves one complete file."""
    monkeypatch.setattr(writer_module, "CHECKPOINT_COMMITS", 4)
    db = tmp_path / "r" / "rank0.sqlite"
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        writer = scope.writer
        limit = writer._con.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        assert limit == writer_module.WAL_LIMIT_PAGES
        record(scope, range(12))
        scope.flush()
        alone = tmp_path / "alone.sqlite"  # the database file without its -wal

        def steps_in_the_file_alone() -> int:
            alone.write_bytes(db.read_bytes())
            con = sqlite3.connect(alone)
            try:
                return con.execute("SELECT count(*) FROM steps").fetchone()[0]
            except sqlite3.DatabaseError:  # copied while a checkpoint wrote it: look again
                return 0
            finally:
                con.close()

        # The checkpointer runs on its own thread; the first checkpoint may have run after
        # step 0 alone, the next may still be running: wait for one that holds 4 steps.
        for _ in range(200):
            if writer.checkpointer.checkpoints >= 1 and steps_in_the_file_alone() >= 4:
                break
            time.sleep(0.05)
        assert writer.checkpointer.checkpoints >= 1
        assert steps_in_the_file_alone() >= 4
    assert not (tmp_path / "r" / "rank0.sqlite-wal").exists() or \
        (tmp_path / "r" / "rank0.sqlite-wal").stat().st_size == 0
    assert deepscope.open_run(tmp_path / "r").steps() == list(range(12))


def hold_writer_in_step_0(monkeypatch) -> tuple[threading.Event, threading.Event, list]:
    """The writer waits inside step 0 until released; returns (inside, release, the items of
    each transaction)."""
    inside, release, transactions = threading.Event(), threading.Event(), []
    write, transaction = StoreWriter._write, StoreWriter._transaction

    def held(self: StoreWriter, item: object) -> None:
        if isinstance(item, StepPayload) and item.step == 0:
            inside.set()
            release.wait(60)
        write(self, item)

    def counting(self: StoreWriter, pairs: list) -> None:
        transaction(self, pairs)  # counted once committed
        transactions.append([i.step if isinstance(i, StepPayload) else type(i).__name__
                             for i, _ in pairs])

    monkeypatch.setattr(StoreWriter, "_write", held)
    monkeypatch.setattr(StoreWriter, "_transaction", counting)
    return inside, release, transactions


def test_steps_queued_behind_each_other_share_one_commit_in_order(tmp_path, monkeypatch):
    """Steps 1-3 wait behind step 0: one commit for them; the note queued after them, then
    step 4, follow in order. Each step reads back whole."""
    inside, release, transactions = hold_writer_in_step_0(monkeypatch)
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        record(scope, range(1))
        assert inside.wait(60)
        record(scope, range(1, 4))
        scope.note("between")
        record(scope, range(4, 5))
        release.set()
        scope.flush()
        written = [t for t in transactions if t != ["_Status"]]
    assert written == [[0], [1, 2, 3], ["_Note"], [4]]
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0, 1, 2, 3, 4] and list(run.kpis("k")["step"]) == [0, 1, 2, 3, 4]
    for step in run.steps():
        assert (run.values("x", step, view="samples") == step).all()
    assert list(run.notes()["text"]) == ["between"]


def fail_writing(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Make writing `step` fail inside its transaction, after all its rows are inserted."""
    write_step = StoreWriter._write_step

    def failing(self: StoreWriter, p: StepPayload, summary: object) -> None:
        write_step(self, p, summary)
        if p.step == step:
            raise sqlite3.IntegrityError("crafted failure")

    monkeypatch.setattr(StoreWriter, "_write_step", failing)


def test_a_failing_step_in_a_group_is_skipped_alone(tmp_path, monkeypatch):
    """Step 2 of the group 1-3 cannot be written: the group is rolled back and its steps
    written one by one; step 2 alone is skipped (its KPIs kept), 1 and 3 are committed."""
    inside, release, transactions = hold_writer_in_step_0(monkeypatch)
    fail_writing(monkeypatch, 2)
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        record(scope, range(1))
        assert inside.wait(60)
        record(scope, range(1, 4))
        release.set()
        with pytest.raises(deepscope.RecordingError, match="step 2 skipped"):
            scope.flush()
        written = list(transactions)
    assert written == [[0], [1], ["_Kpis"], [3]]  # step 2's KPIs in its place
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0, 1, 3] and list(run.kpis("k")["step"]) == [0, 1, 2, 3]


def test_a_tensor_first_written_by_a_rolled_back_step_is_written_again(tmp_path, monkeypatch):
    """Regression: step 0 introduces tensor "x" and fails inside its transaction (rolled
    back, skipped); the writer kept x's id from the rolled-back insert, so step 1's records
    pointed at a tensor row that was never committed and read as nothing."""
    fail_writing(monkeypatch, 0)
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        record(scope, range(1))
        with pytest.raises(deepscope.RecordingError, match="step 0 skipped"):
            scope.flush()
        record(scope, range(1, 2))
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [1]
    assert list(run.tensors()["name"]) == ["x"]
    stats = run.stats_wide("x")
    assert list(stats["step"]) == [1] and float(stats["mean"].iloc[0]) == 1.0
