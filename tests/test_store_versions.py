"""Schema versions: a new run is written in version 3 (`arrays` keyed by step first: a step's
rows appended together), and a version-2 run (keyed by tensor first) still reads, and resumes
in its own layout and version."""

from __future__ import annotations

import sqlite3

import numpy as np
import torch

import deepscope
from tests.helpers import MLP3, record_step, train_mlp

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


def arrays_key(db) -> list[str]:
    """The primary key columns of `arrays`, in key order."""
    con = sqlite3.connect(db)
    try:
        cols = con.execute("PRAGMA table_info(arrays)").fetchall()
    finally:
        con.close()
    return [name for _, name, _, _, _, pk in sorted(cols, key=lambda c: c[5]) if pk]


def snapshot(run) -> tuple:
    values = {(t, s, v): run.values(t, s, view=v).tolist()
              for t in ("h1", "l1.weight") for s in run.steps()
              for v in run.views(t, s)}
    return run.steps(), run.stats_wide().fillna(-1.0).to_numpy().tolist(), values


def test_new_runs_key_arrays_by_step_first(tmp_path):
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        train_mlp(scope, steps=2)
    db = tmp_path / "r" / "rank0.sqlite"
    assert arrays_key(db) == ["step", "tensor_id", "direction", "iteration", "view"]
    assert deepscope.open_run(tmp_path / "r").meta()["schema_version"] == "3"


def test_a_version_2_run_reads_and_resumes_in_its_own_layout(tmp_path):
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        train_mlp(scope, steps=2)
    run_dir, db = tmp_path / "r", tmp_path / "r" / "rank0.sqlite"
    before = snapshot(deepscope.open_run(run_dir))
    con = sqlite3.connect(db)
    con.executescript(V2_ARRAYS)
    con.close()
    run = deepscope.open_run(run_dir)
    assert run.meta()["schema_version"] == "2"
    assert snapshot(run) == before and before[2]  # same steps, statistics and views
    assert run.views("h1", 1) and np.isfinite(run.values("h1", 1, view="samples")).all()
    run.close()
    model = MLP3()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deepscope.Scope(tmp_path, "r", schedule=1, resume=True) as scope:
        scope.watch(model)
        for step in (2, 3):
            record_step(scope, model, opt, step, torch.randn(8, 6), torch.randint(0, 3, (8,)))
    run = deepscope.open_run(run_dir)
    assert run.steps() == [0, 1, 2, 3]
    assert run.meta()["schema_version"] == "2"  # not relabelled: the layout is version 2's
    assert arrays_key(db) == ["tensor_id", "direction", "step", "iteration", "view"]
    assert run.views("h1", 3) == run.views("h1", 0)
