"""examples/ddp.py runs under torchrun (2 processes, gloo) and records every rank."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

from tests.distributed.harness import ROOT, free_port


def test_ddp_example_runs_under_torchrun(tmp_path):
    import deepscope

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}",
         str(ROOT / "examples" / "ddp.py"), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"recorded {tmp_path}/ddp (2 ranks)" in done.stdout
    run = deepscope.open_run(tmp_path / "ddp")
    for rank in (0, 1):
        meta = run.meta(rank=rank)
        shared = meta["distributed"]
        shared = json.loads(shared) if isinstance(shared, str) else shared
        assert shared["world_size"] == 2 and shared["rank"] == rank
        assert run.status(rank=rank) == "finished"
        assert run.steps(rank=rank) == [0, 10, 20, 30]
    # the global batch's instrument values: in rank 0's file only; local ones in each
    steps = {0, 5, 10, 15, 20, 25, 30, 35}
    assert {s for (s,) in rows(tmp_path, 0, "SELECT step FROM quantities")} == steps
    assert rows(tmp_path, 1, "SELECT count(*) FROM quantities") == [(0,)]
    for rank in (0, 1):
        local = rows(tmp_path, rank, "SELECT DISTINCT name, step FROM local_quantities")
        assert {n for n, _ in local} >= {"BatchSize", "GradNorm", "Loss"}
        # instrumented: the due steps and the next ones (α's end point)
        assert {s for _, s in local} == steps | {s + 1 for s in steps}


def rows(root, rank: int, sql: str) -> list[tuple]:
    con = sqlite3.connect(f"file:{root / 'ddp' / f'rank{rank}.sqlite'}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()
