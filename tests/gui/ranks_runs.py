"""Distributed runs for the GUI's rank tests, written in one process: one Scope per rank
(what each rank of a DDP job writes), local values per rank, global values on rank 0."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import torch

import deepscope
from deepscope.instruments.base import QuantityValue

from .conftest import Net, train_step

STEPS = 5


def local_loss(rank: int, step: int, bad: int | None = None) -> float:
    """The local loss rank `rank` stores at `step` (rank `bad`: a shard 5 times worse)."""
    return (1.0 / (step + 1) + 0.1 * rank) * (5.0 if rank == bad else 1.0)


def local_norm(rank: int, step: int) -> float:
    return 2.0 + step + 0.5 * rank


def record_ranks(path: Path, run: str, world: int = 2, present: tuple[int, ...] = (0, 1),
                 bad: int | None = None, other_graph: int | None = None) -> None:
    """Ranks `present` of a `world`-rank run: the same model on every rank, each rank its
    own batches; rank `other_graph` also records a tensor the others do not (its graph
    differs); rank `bad` stores local losses 5 times the others'. Local GradNorm also for
    layer "out.weight" (a tenth of the whole model's). Rank 0 also stores the global batch's
    Loss and GradNorm (the mean of the present ranks' local values)."""
    run_id = None
    for rank in present:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scope = deepscope.Scope(path, run=run, rank=rank, schedule=deepscope.every(1),
                                max_samples=2, resume=rank != present[0])
        try:
            scope.watch(model)
            for step in range(STEPS):
                torch.manual_seed(100 * rank + step)
                if rank == other_graph:
                    with scope.step(step, kind="train") as rec:
                        rec.tensor("extra", torch.randn(4, 2))
                        out = model(torch.randn(4, 5), rec)
                        rec.tensor("output", out, role="output")
                else:
                    train_step(scope, model, opt, step)
                values = [QuantityValue("Loss", step, "", local_loss(rank, step, bad),
                                        local=True),
                          QuantityValue("GradNorm", step, "", local_norm(rank, step),
                                        local=True),
                          QuantityValue("GradNorm", step, "out.weight",
                                        local_norm(rank, step) / 10, local=True),
                          QuantityValue("BatchSize", step, "", 4.0, local=True)]
                if rank == 0:
                    values += [QuantityValue(name, step, layer, sum(
                        f(r, step) for r in present) / len(present) / scale)
                        for name, layer, scale, f in (
                            ("Loss", "", 1, lambda r, s: local_loss(r, s, bad)),
                            ("GradNorm", "", 1, local_norm),
                            ("GradNorm", "out.weight", 10, local_norm))]
                scope.writer.submit_quantities(values)
        finally:
            scope.close()
        db = path / run / f"rank{rank}.sqlite"
        con = sqlite3.connect(db)
        with con:
            if run_id is None:
                run_id = json.loads(con.execute(
                    "SELECT value FROM meta WHERE key = 'run_id'").fetchone()[0])
            con.execute("INSERT OR REPLACE INTO meta VALUES ('distributed', ?)", (json.dumps(
                {"world_size": world, "rank": rank, "backend": "gloo", "run_id": run_id}),))
        con.close()
