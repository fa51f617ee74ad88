"""Reading a distributed run (#15 item 5): every rank file, checked, merged exactly.

Rank files are written in one process, without a process group: one `Scope(rank=r)` per
rank, the `distributed` manifest written into each file's meta afterwards.
"""

from __future__ import annotations

import json
import sqlite3
import uuid

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepscope
from deepscope.cli.main import main
from deepscope.errors import CorruptRunError, DeepscopeWarning
from deepscope.query import merge
from deepscope.recorder.stats import tensor_stats
from deepscope.records import QuantityValue
from deepscope.store.schema import STAT_COLUMNS

STEPS = 2
WEIGHT = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(3, 4)


def batch(step: int) -> torch.Tensor:
    """The global batch of a step: 16 items of 5 float64 values, with zeros, a NaN, ±Inf."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 5, generator=g, dtype=torch.float64) * 3 + 1.5
    x[2, 1] = x[9, 4] = 0.0
    x[10, 0] = float("nan")
    x[12, 3], x[3, 2] = float("inf"), float("-inf")
    return x


def record(scope: deepscope.Scope, step: int, x: torch.Tensor, sizes: dict | None) -> None:
    with scope.step(step) as rec:
        act = x.clone().requires_grad_(True)
        rec.tensor("act", act, batch_dim=0)
        rec.tensor("w", WEIGHT, role="parameter")
        torch.nan_to_num(act, 0.0, 0.0, 0.0).square().sum().backward()
    if sizes is not None:
        scope.writer.submit_quantities([QuantityValue("BatchSize", step, value=sizes[step],
                                                      local=True)])


def set_meta(db, **values) -> None:
    con = sqlite3.connect(db)
    with con:
        con.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                        [(k, json.dumps(v)) for k, v in values.items()])
    con.close()


def distributed_run(tmp_path, name: str = "ddp", split: int = 7, world: int = 2,
                    ranks: tuple[int, ...] = (0, 1), batch_sizes: bool = True) -> str:
    """Rank 0 records items [0, split) of every step's global batch, rank 1 the rest; both
    Scopes are open at once (as on two processes)."""
    scopes = {r: deepscope.Scope(tmp_path, name, rank=r, schedule=1, anomalies=False,
                                 exact_views=True) for r in ranks}
    for step in range(STEPS):
        x = batch(step)
        halves = {0: x[:split], 1: x[split:]}
        for r, scope in scopes.items():
            sizes = {s: len(halves[r]) for s in range(STEPS)} if batch_sizes else None
            record(scope, step, halves[r], sizes)
    scopes[0].writer.submit_quantities([QuantityValue("GradNorm", 0, value=4.0)])  # global
    for scope in scopes.values():
        scope.close()
    run_id = uuid.uuid4().hex
    for r in ranks:
        set_meta(tmp_path / name / f"rank{r}.sqlite", distributed={
            "world_size": world, "rank": r, "backend": "gloo", "run_id": run_id})
    return name


def whole_run(tmp_path) -> deepscope.Run:
    with deepscope.Scope(tmp_path, "whole", schedule=1, anomalies=False,
                         exact_views=True) as scope:
        for step in range(STEPS):
            record(scope, step, batch(step), None)
    return deepscope.open_run(tmp_path / "whole")


def test_merged_statistics_equal_the_single_process_ones_of_the_concatenated_batch(tmp_path):
    whole = whole_run(tmp_path).stats_wide()
    run = deepscope.open_run(tmp_path / distributed_run(tmp_path))
    assert run.ranks == [0, 1] and run.world_size == 2
    merged = run.stats_wide()
    assert list(merged.columns) == list(whole.columns)
    assert merged[["step", "iteration", "tensor", "direction"]].equals(
        whole[["step", "iteration", "tensor", "direction"]])
    stats = [c for c in STAT_COLUMNS if c != "sv_max"]
    np.testing.assert_allclose(merged[stats].to_numpy(), whole[stats].to_numpy(), rtol=1e-10)
    batched = merged["tensor"] == "act"
    assert set(merged.loc[batched, "direction"]) == {"forward", "grad"}
    assert merged.loc[batched, "sv_max"].isna().all()  # not mergeable
    forward = batched & (merged["direction"] == "forward")
    assert merged.loc[forward, ["nan", "posinf", "neginf"]].eq(1).all().all()
    # the long form and one statistic read the same merged values
    long = run.stats("act", statistic="std", direction="forward")
    np.testing.assert_allclose(long["value"], whole.loc[
        (whole["tensor"] == "act") & (whole["direction"] == "forward"), "std"], rtol=1e-10)


def test_rank_filters(tmp_path):
    run = deepscope.open_run(tmp_path / distributed_run(tmp_path))
    one = run.stats_wide("act", rank=1, direction="forward")
    x = batch(0)[7:]
    finite = x[torch.isfinite(x)]
    assert one["numel"].iloc[0] == x.numel()
    assert one["mean"].iloc[0] == pytest.approx(float(finite.mean()), rel=1e-12)
    every = run.stats_wide(rank="all")
    assert list(every.columns[:2]) == ["rank", "step"]
    assert sorted(set(every["rank"])) == [0, 1]
    assert every[every["rank"] == 1].drop(columns="rank").reset_index(drop=True).equals(
        run.stats_wide(rank=np.int64(1)))  # a rank as pandas hands it out
    assert "rank" in run.stats(rank="all").columns
    with pytest.raises(ValueError, match="rank must be a rank number, 'merged' or 'all'"):
        run.stats(rank="global")
    with pytest.raises(ValueError, match="has no rank 5"):
        run.stats(rank=5)
    with pytest.raises(ValueError, match="view 'neuron_mean' has no row per batch item"):
        run.samples("act", 0, view="neuron_mean")


def test_unbatched_records_that_differ_between_ranks_are_rank_0s_with_a_warning(tmp_path):
    name = distributed_run(tmp_path)
    con = sqlite3.connect(tmp_path / name / "rank1.sqlite")  # as a pre-sync local gradient
    with con:
        con.execute("UPDATE records SET mean = mean + 1 WHERE tensor_id = "
                    "(SELECT id FROM tensors WHERE name = 'w') AND step = 1")
    con.close()
    run = deepscope.open_run(tmp_path / name)
    with pytest.warns(DeepscopeWarning, match="records of 'w' .no batch dimension. differ "
                      "between ranks; merged shows rank 0's"):
        merged = run.stats_wide("w")
    assert merged["mean"].tolist() == run.stats_wide("w", rank=0)["mean"].tolist()


def test_single_process_runs_read_unchanged(tmp_path):
    run = whole_run(tmp_path)
    assert run.ranks == [0] and run.world_size == 1
    assert run.stats_wide().equals(run.stats_wide(rank=0))
    assert list(run.warnings().columns) == ["step", "location", "quantities", "message"]
    assert list(run.rank_status()["status"]) == ["finished"]
    items = run.samples("act", 0)
    assert items["sample"].tolist() == list(range(16)) and items["global_index"].all()


def test_two_rank_writers_of_one_run_coexist(tmp_path):
    first = deepscope.Scope(tmp_path, "r", rank=0, schedule=1)
    deepscope.Scope(tmp_path, "r", rank=1, schedule=1).close()  # was: "run already exists"
    first.close()
    with pytest.raises(ValueError, match="already exists"):
        deepscope.Scope(tmp_path, "r", rank=1)  # its own file is still refused


def test_missing_and_crashed_ranks_are_reported_and_the_rest_opens(tmp_path, capsys):
    name = distributed_run(tmp_path, world=3)
    set_meta(tmp_path / name / "rank1.sqlite", status="recording")  # no writer holds it
    run = deepscope.open_run(tmp_path / name)
    assert run.ranks == [0, 1] and run.world_size == 3
    status = run.rank_status()
    assert list(status["status"]) == ["finished", "crashed", "missing"]
    assert list(status["steps"]) == [STEPS, STEPS, 0]
    assert status["last_step"].iloc[1] == STEPS - 1 and pd.isna(status["last_step"].iloc[2])
    assert "no file rank2.sqlite" in status["problem"].iloc[2]
    assert "stopped without closing" in status["problem"].iloc[1]
    with pytest.warns(DeepscopeWarning, match="rank 2 has no readable file"):
        merged = run.stats_wide()
    act = merged[merged["tensor"] == "act"]
    assert act[list(STAT_COLUMNS)].isna().all().all()  # 2 of 3 micro-batches: not the batch
    assert merged.loc[merged["tensor"] == "w", "numel"].eq(12).all()  # parameters: rank 0's
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ranks: 2 of world size 3 readable; rank 2 missing; rank 1 crashed" in out
    assert main(["doctor", str(tmp_path / name)]) == 0
    assert "[ranks: 2 of world size 3 readable; rank 2 missing" in capsys.readouterr().out


def test_a_rank_file_of_another_run_is_left_out_with_a_warning(tmp_path):
    name = distributed_run(tmp_path)
    db = tmp_path / name / "rank1.sqlite"
    set_meta(db, distributed={"world_size": 2, "rank": 1, "backend": "gloo",
                              "run_id": uuid.uuid4().hex})
    run = deepscope.open_run(tmp_path / name)
    with pytest.warns(DeepscopeWarning, match=r"rank1\.sqlite is left out of this run: it "
                      "belongs to another run"):
        assert run.ranks == [0]
    status = run.rank_status()
    assert list(status["status"]) == ["finished", "left out"]
    with pytest.raises(CorruptRunError, match="rank1.sqlite is left out of run 'ddp'"):
        run.stats(rank=1)
    with pytest.warns(DeepscopeWarning, match="NaN where a rank has no record"):
        assert run.stats_wide("act")[list(STAT_COLUMNS)].isna().all().all()


def test_global_sample_index(tmp_path):
    whole = whole_run(tmp_path)
    run = deepscope.open_run(tmp_path / distributed_run(tmp_path))
    items = run.samples("act", 1, view="sample_mean")
    assert list(items.columns) == ["rank", "sample", "local_sample", "global_index", "value"]
    assert items["sample"].tolist() == list(range(16))  # 7 items of rank 0, then rank 1's 9
    assert items["global_index"].all()
    assert items.loc[items["rank"] == 1, "local_sample"].tolist() == list(range(9))
    reference = whole.values("act", 1, view="sample_mean")
    np.testing.assert_array_equal(items["value"].to_numpy(), reference)
    full = run.samples("act", 1, view="samples", rank=1)
    assert full["sample"].tolist() == [7, 8, 9, 10]  # max_samples=4 items stored per rank
    np.testing.assert_array_equal(full["value"].iloc[0], batch(1)[7].float().numpy())


def test_unknown_batch_sizes_keep_the_local_index_and_say_so(tmp_path):
    run = deepscope.open_run(tmp_path / distributed_run(tmp_path, batch_sizes=False))
    with pytest.warns(DeepscopeWarning, match="global batch index of rank 1's items is "
                      "unknown"):
        items = run.samples("act", 0)
    rank1 = items[items["rank"] == 1]
    assert rank1["sample"].tolist() == list(range(9)) and not rank1["global_index"].any()
    assert items.loc[items["rank"] == 0, "global_index"].all()  # nothing below rank 0


def test_quantities_global_local_and_all(tmp_path):
    name = distributed_run(tmp_path, split=6)
    db = tmp_path / name / "rank1.sqlite"
    run = deepscope.open_run(tmp_path / name)
    assert run.quantities()[["name", "value"]].values.tolist() == [["GradNorm", 4.0]]
    assert run.quantities("BatchSize", rank=1)["value"].tolist() == [10.0] * STEPS
    every = run.quantities(rank="all")
    assert list(every.columns[:3]) == ["rank", "step", "name"]
    assert every.groupby("rank")["value"].first().to_dict() == {0: 6.0, 1: 10.0}
    run.close()
    con = sqlite3.connect(db)  # a file recorded before local values had their table
    con.execute("DROP TABLE local_quantities")
    con.commit()
    con.close()
    assert deepscope.open_run(tmp_path / name).quantities(rank=1).empty


def test_warnings_and_anomalies_of_every_rank(tmp_path):
    name = distributed_run(tmp_path, ranks=(0,), world=2)
    with deepscope.Scope(tmp_path, name, rank=1, schedule=1, anomalies=False) as scope:
        scope.writer.submit_anomalies([(0, "act", "nonfinite", None, None, "NaN on rank 1")])
    db = tmp_path / name / "rank1.sqlite"
    set_meta(db, distributed=deepscope.open_run(tmp_path / name).meta()["distributed"]
             | {"rank": 1})
    run = deepscope.open_run(tmp_path / name)
    found = run.anomalies()
    assert list(found.columns[:2]) == ["rank", "step"]
    assert found[["rank", "message"]].values.tolist() == [[1, "NaN on rank 1"]]
    assert run.anomalies(0).empty and "rank" not in run.anomalies(0).columns
    assert list(run.warnings().columns) == ["rank", "step", "location", "quantities",
                                            "message"]


def reference_stats(x: np.ndarray) -> dict[str, float]:
    """The recorder's definitions, brute force in numpy (independent of the merge)."""
    finite = x[np.isfinite(x)]
    out = {"numel": x.size, "nan": np.isnan(x).sum(), "posinf": np.isposinf(x).sum(),
           "neginf": np.isneginf(x).sum(), "norm": np.sqrt(np.sum(finite ** 2)),
           "zero_frac": np.count_nonzero(x == 0) / max(x.size, 1)}
    if finite.size:
        out |= {"mean": finite.mean(), "std": finite.std(), "abs_mean": np.abs(finite).mean(),
                "min": finite.min(), "max": finite.max(), "abs_max": np.abs(finite).max()}
    else:
        out |= dict.fromkeys(("mean", "std", "abs_mean", "min", "max", "abs_max"), np.nan)
    return out


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
       seed=st.integers(0, 2**16), shift=st.floats(-5, 5), bad=st.floats(0, 0.6))
def test_merge_equals_brute_force_on_the_concatenation(sizes, seed, shift, bad):
    """Any split into ranks, some ranks all zeros or all non-finite: merged = reference."""
    rng = np.random.default_rng(seed)
    parts = [rng.normal(shift, 2.0, (n, 3)) for n in sizes]
    for p in parts:
        p[rng.random(p.shape) < bad] = rng.choice([np.nan, np.inf, -np.inf, 0.0])
    rows = [{"rank": r, "step": 0, "iteration": 0, "tensor": "a", "direction": "forward",
             **dict(zip(STAT_COLUMNS, tensor_stats(torch.from_numpy(p)).tolist()))}
            for r, p in enumerate(parts)]
    merged, incomplete, differing = merge.merge(pd.DataFrame(rows), {"a"}, len(parts))
    assert incomplete == [] and differing == []
    want = reference_stats(np.concatenate(parts))
    for column, value in want.items():
        np.testing.assert_allclose(merged[column].iloc[0], value, rtol=1e-10, atol=1e-12,
                                   err_msg=column)
    assert np.isnan(merged["sv_max"].iloc[0])


def test_a_damaged_manifest_leaves_its_file_out(tmp_path):
    name = distributed_run(tmp_path)
    set_meta(tmp_path / name / "rank1.sqlite", distributed={"world_size": 10**9, "rank": 1,
                                                            "run_id": "x"})
    run = deepscope.open_run(tmp_path / name)
    with pytest.warns(DeepscopeWarning, match="stored meta 'distributed' is not a manifest"):
        assert run.ranks == [0] and run.world_size == 2
    assert run.rank_status()["status"].tolist() == ["finished", "left out"]


def test_a_damaged_rank_0_leaves_the_other_ranks_readable(tmp_path):
    name = distributed_run(tmp_path)
    (tmp_path / name / "rank0.sqlite").write_bytes(b"garbage" * 10)
    run = deepscope.open_run(tmp_path / name)
    with pytest.warns(DeepscopeWarning, match=r"rank0\.sqlite is left out of this run: .*not "
                      "a deepscope store"):
        assert run.ranks == [1] and run.world_size == 2  # rank 1's manifest
    assert run.rank_status()["status"].tolist() == ["left out", "finished"]
    assert len(run.stats_wide("act", rank=1)) == 2 * STEPS
    with pytest.raises(CorruptRunError, match="not a deepscope store"):
        run.quantities()  # the global values are in rank 0's file
