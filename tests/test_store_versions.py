"""Schema versions: a new run is written in version 4 (`records` keyed by step first, a step's
arrays indexed by one `step_arrays` row naming a shared layout, parts under the codecs
sparse4 / split2-zlib); runs of versions 3 and 2 still read, value for value, and resume in
their own layout, version and codecs.

tests/data/v3-run is a real version-3 run, recorded by deepscope a5b276f (the last release
writing version 3) with `record_reference` below:
    PYTHONPATH=<that checkout>/src python -c "from tests.test_store_versions import *; \\
        record_reference(Path('tests/data'), 'v3-run')"
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import deepscope
from tests.helpers import MLP3, record_step

FIXTURE = Path(__file__).parent / "data" / "v3-run"

V2_ARRAYS = """
CREATE TABLE arrays_v2 (
    tensor_id INTEGER NOT NULL, direction TEXT NOT NULL, view TEXT NOT NULL,
    step INTEGER NOT NULL, iteration INTEGER NOT NULL, dtype TEXT NOT NULL, shape TEXT NOT NULL,
    part INTEGER NOT NULL, offset INTEGER NOT NULL, nbytes INTEGER NOT NULL,
    PRIMARY KEY (tensor_id, direction, step, iteration, view)) WITHOUT ROWID;
INSERT INTO arrays_v2 SELECT * FROM arrays;
DROP TABLE arrays;
ALTER TABLE arrays_v2 RENAME TO arrays;
UPDATE meta SET value = '2' WHERE key = 'schema_version';
"""


def record_reference(root: Path, name: str, steps: int = 3) -> None:
    """The reference run: MLP3 with ReLUs (mostly-zero samples), bfloat16 views, seeded."""
    torch.manual_seed(0)
    model = MLP3()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deepscope.Scope(root, name, schedule=1, max_samples=3, overwrite=True) as scope:
        scope.watch(model)
        for step in range(steps):
            record_step(scope, model, opt, step, torch.randn(8, 6), torch.randint(0, 3, (8,)))


def key_columns(db: Path, table: str) -> list[str]:
    """The primary key columns of `table`, in key order."""
    con = sqlite3.connect(db)
    try:
        cols = con.execute(f"PRAGMA table_info({table})").fetchall()
    finally:
        con.close()
    return [name for _, name, _, _, _, pk in sorted(cols, key=lambda c: c[5]) if pk]


def codecs_used(db: Path) -> set[str]:
    con = sqlite3.connect(db)
    try:
        return {c for (c,) in con.execute("SELECT codec FROM step_blobs")}
    finally:
        con.close()


def snapshot(run) -> tuple:
    """Everything a reader gets of the run's records: steps, statistics, every view."""
    wide = run.stats_wide()
    values = {(t, d, s, v): run.values(t, s, view=v, direction=d).tolist()
              for t, d in sorted(set(zip(wide["tensor"], wide["direction"])))
              for s in run.steps() for v in run.views(t, s, direction=d)}
    return run.steps(), wide.fillna(-1.0).to_numpy().tolist(), values


def resume_fixture(tmp_path: Path) -> None:
    """Record steps 3 and 4 into the copied fixture run, resumed."""
    model = MLP3()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deepscope.Scope(tmp_path, "v3-run", schedule=1, resume=True) as scope:
        scope.watch(model)
        for step in (3, 4):
            record_step(scope, model, opt, step, torch.randn(8, 6), torch.randint(0, 3, (8,)))


def copy_fixture(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURE, tmp_path / "v3-run")
    return tmp_path / "v3-run"


def test_new_runs_are_version_4_keyed_by_step_with_one_layout(tmp_path):
    record_reference(tmp_path, "r")
    db = tmp_path / "r" / "rank0.sqlite"
    assert key_columns(db, "records") == ["step", "iteration", "tensor_id", "direction"]
    con = sqlite3.connect(db)
    try:
        counts = [con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                  for t in ("arrays", "step_arrays", "layouts")]
        used = con.execute("SELECT count(DISTINCT layout) FROM step_arrays").fetchone()[0]
        # a missing statistic (NaN in the summary: sv_max here) is stored as NULL
        sv_max = {v for (v,) in con.execute("SELECT sv_max FROM records")}
    finally:
        con.close()
    # no row per array, one index row per step; a layout is stored once for the steps that
    # share it (step 0's targets have fewer zeros: their samples sit in another part)
    assert counts == [0, 3, 2] and used == 2
    assert sv_max == {None}
    assert codecs_used(db) == {"sparse4", "raw", "split2-zlib"}
    assert deepscope.open_run(tmp_path / "r").meta()["schema_version"] == "4"


def stored_v3(db: Path) -> tuple[dict, list]:
    """What a version-3 file holds, decoded with sqlite3, zlib and numpy alone (not the
    reader): {(tensor, direction, step, view): array}, and the records' rows."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        parts = {}
        for step, part, codec, raw_bytes, data in con.execute("SELECT * FROM step_blobs"):
            raw = data if codec == "raw" else zlib.decompress(data)
            if codec == "shuffle2-zlib":
                raw = np.frombuffer(raw, np.uint8).reshape(2, -1).T.tobytes()
            assert len(raw) == raw_bytes
            parts[step, part] = raw
        arrays = {}
        for name, direction, view, step, dtype, shape, part, offset, nbytes in con.execute(
                "SELECT t.name, a.direction, a.view, a.step, a.dtype, a.shape, a.part, a.offset,"
                " a.nbytes FROM arrays a JOIN tensors t ON t.id = a.tensor_id"):
            chunk = parts[step, part][offset:offset + nbytes]
            if dtype == "bfloat16":
                values = (np.frombuffer(chunk, "<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                values = np.frombuffer(chunk, np.dtype(dtype).newbyteorder("<"))
            arrays[name, direction, step, view] = values.reshape(json.loads(shape))
        records = con.execute(
            "SELECT r.step, r.iteration, t.name, r.direction, r.numel, r.mean, r.std, "
            "r.abs_mean, r.min, r.max, r.abs_max, r.norm, r.zero_frac, r.nan, r.posinf, "
            "r.neginf, r.sv_max FROM records r JOIN tensors t ON t.id = r.tensor_id "
            "ORDER BY r.step, r.iteration, t.id, r.direction").fetchall()
    finally:
        con.close()
    return arrays, records


def test_a_version_3_run_reads_what_its_file_holds(tmp_path):
    """Every array and statistic of the version-3 fixture reads back bitwise as the file
    holds it (decoded independently of the reader)."""
    run_dir = copy_fixture(tmp_path)
    arrays, records = stored_v3(run_dir / "rank0.sqlite")
    with deepscope.open_run(run_dir) as run:
        assert run.meta()["schema_version"] == "3"
        got = {(t, d, s, v): run.values(t, s, view=v, direction=d) for t, d, s, v in arrays}
        wide = run.stats_wide()
    assert len(arrays) > 100 and len(records) == len(wide)
    for key, values in arrays.items():
        assert got[key].dtype == np.float32 and np.array_equal(
            got[key].view(np.uint32), values.astype(np.float32).view(np.uint32)), key
    assert wide.astype(object).where(wide.notna(), None).values.tolist() == \
        [list(r) for r in records]


def test_a_version_3_run_reads_like_the_same_run_recorded_now(tmp_path):
    """The same seeded run recorded by the version-3 release and by this one: the same
    steps, records and views; the stored samples bitwise equal, the statistics and views equal
    to their promised precision (~1e-7 of the scale of float32 data; one bfloat16 rounding):
    how they are computed may change, what the file holds may not."""
    record_reference(tmp_path, "new")
    with deepscope.open_run(copy_fixture(tmp_path)) as old, \
            deepscope.open_run(tmp_path / "new") as new:
        (steps, stats, values), (steps_now, stats_now, values_now) = snapshot(old), snapshot(new)
    assert steps == steps_now and values.keys() == values_now.keys() and len(values) > 100
    assert [r[:4] for r in stats] == [r[:4] for r in stats_now]
    np.testing.assert_allclose(np.array([r[4:] for r in stats], float),
                               np.array([r[4:] for r in stats_now], float), rtol=1e-6,
                               atol=1e-6)
    for key, got in values.items():
        if key[3] == "samples":
            assert got == values_now[key], key
        else:
            np.testing.assert_allclose(got, values_now[key], rtol=2**-7, atol=1e-6,
                                       err_msg=str(key))


def test_a_version_3_run_resumes_in_its_own_layout_and_codecs(tmp_path):
    run_dir = copy_fixture(tmp_path)
    db = run_dir / "rank0.sqlite"
    resume_fixture(tmp_path)
    with deepscope.open_run(run_dir) as run:
        assert run.steps() == [0, 1, 2, 3, 4]
        assert run.meta()["schema_version"] == "3"  # not relabelled: the layout is 3's
        assert run.views("h1", 4) == run.views("h1", 0)
        assert np.isfinite(run.values("h1", 4, view="samples")).all()
    assert key_columns(db, "records") == ["tensor_id", "direction", "step", "iteration"]
    # readable by the version-3 release: only its codecs, and every array in `arrays`
    assert codecs_used(db) <= {"raw", "zlib", "shuffle2-zlib"}
    con = sqlite3.connect(db)
    try:
        assert con.execute("SELECT count(DISTINCT step) FROM arrays").fetchone()[0] == 5
        assert con.execute("SELECT count(*) FROM step_arrays").fetchone()[0] == 0
    finally:
        con.close()


def test_a_version_2_run_reads_and_resumes_in_its_own_layout(tmp_path):
    run_dir = copy_fixture(tmp_path)
    db = run_dir / "rank0.sqlite"
    with deepscope.open_run(run_dir) as run:
        before = snapshot(run)
    con = sqlite3.connect(db)
    con.executescript(V2_ARRAYS)
    con.close()
    run = deepscope.open_run(run_dir)
    assert run.meta()["schema_version"] == "2"
    assert snapshot(run) == before and before[2]  # same steps, statistics and views
    run.close()
    resume_fixture(tmp_path)
    run = deepscope.open_run(run_dir)
    assert run.steps() == [0, 1, 2, 3, 4]
    assert run.meta()["schema_version"] == "2"  # not relabelled: the layout is version 2's
    assert key_columns(db, "arrays") == ["tensor_id", "direction", "step", "iteration", "view"]
    assert run.views("h1", 4) == run.views("h1", 0)
    run.close()


def test_a_layout_whose_step_was_rolled_back_is_written_again(tmp_path, monkeypatch):
    """Step 1 brings a new layout and fails after inserting it (rolled back, skipped): step 2,
    of the same layout, must store it again, not point at a row that was never committed."""
    from deepscope.store.writer import StoreWriter
    write_quantities = StoreWriter._write_quantities

    def failing_at_step_1(self, values):
        if self._layout is not None and self._new_layout:
            raise sqlite3.IntegrityError("step 1 fails after its layout was inserted")
        write_quantities(self, values)

    with deepscope.Scope(tmp_path, "r", schedule=1, max_samples=2) as scope:
        with scope.step(0) as rec:
            rec.tensor("x", torch.ones(2, 3), role="input")
        scope.flush()
        monkeypatch.setattr(StoreWriter, "_write_quantities", failing_at_step_1)
        with scope.step(1) as rec:
            rec.tensor("x", torch.ones(4, 3), role="input")
        with pytest.raises(deepscope.RecordingError, match="step 1 skipped"):
            scope.flush()
        monkeypatch.undo()
        with scope.step(2) as rec:
            rec.tensor("x", torch.full((4, 3), 2.0), role="input")
    with deepscope.open_run(tmp_path / "r") as run:
        assert run.steps() == [0, 2]
        np.testing.assert_array_equal(run.values("x", 2, view="samples"), np.full((2, 3), 2.0))
