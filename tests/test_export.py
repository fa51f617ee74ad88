"""Export to TensorBoard and Parquet, read back with the formats' own readers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import deepscope
from deepscope.cli.main import main as cli
from deepscope.instruments.base import QuantityValue
from tests.helpers import train_mlp


@pytest.fixture
def run_path(tmp_path):
    with deepscope.Scope(tmp_path / "p", "r", schedule=2) as scope:
        train_mlp(scope, steps=4)
        scope.writer.submit_quantities([
            QuantityValue("GradNorm", 0, "", 1.5, meta={"estimator": "exact"}),
            QuantityValue("GradHist1d", 0, "", None, np.array([1, 5, 2, 0], dtype=np.int64),
                          {"edges": [-2.0, 2.0, 4], "underflow": 3, "overflow": 0, "nan": 1,
                           "posinf": 0, "neginf": 0})])
    return tmp_path / "p" / "r"


def test_parquet_tables_match_query_api(run_path, tmp_path):
    assert cli(["export", str(run_path), "--parquet", str(tmp_path / "pq")]) == 0
    run = deepscope.open_run(run_path)
    kpis = pd.read_parquet(tmp_path / "pq" / "kpis.parquet")
    pd.testing.assert_frame_equal(kpis, run.kpis())
    stats = pd.read_parquet(tmp_path / "pq" / "stats.parquet")
    assert len(stats) == len(run.stats_wide()) and stats["step"].unique().tolist() == [0, 2]
    q = pd.read_parquet(tmp_path / "pq" / "quantities.parquet")
    assert set(q["name"]) == {"GradNorm", "GradHist1d"}
    assert list(q.columns) == ["step", "name", "layer", "value", "meta"]


def test_quantity_metadata_flattened_into_columns(run_path):
    q = deepscope.open_run(run_path).quantities().set_index("name")
    assert list(q.columns) == ["step", "layer", "value", "edges", "estimator", "nan",
                               "neginf", "overflow", "posinf", "underflow", "meta"]
    assert q.loc["GradNorm", "estimator"] == "exact" and q.loc["GradHist1d", "underflow"] == 3
    assert np.isnan(q.loc["GradNorm", "underflow"])   # a key this row does not have
    assert q.loc["GradHist1d", "edges"] == [-2.0, 2.0, 4]
    assert q.loc["GradNorm", "meta"] == {"estimator": "exact"}   # the dict column is kept


def test_quantity_metadata_nested_and_clashing_keys(tmp_path):
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.never) as scope:
        scope.writer.submit_quantities([
            QuantityValue("Alpha", 0, "", 0.5, meta={"fit": {"tau": 0.1}, "value": 7}),
            QuantityValue("Loss", 0, "", 1.0)])
    q = deepscope.open_run(tmp_path / "r").quantities()
    assert list(q.columns) == ["step", "name", "layer", "value", "fit.tau", "meta.value",
                               "meta"]
    assert q["value"].tolist() == [0.5, 1.0] and q["meta.value"].tolist()[0] == 7
    assert q["fit.tau"].tolist()[0] == 0.1 and q["meta"].tolist()[1] == {}
    empty = deepscope.open_run(tmp_path / "r").quantities("HessMaxEV")  # known, not tracked
    assert list(empty.columns) == ["step", "name", "layer", "value", "meta"] and empty.empty


def test_tensorboard_events_readable_by_tensorboard(run_path, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    assert cli(["export", str(run_path), "--tensorboard", str(tmp_path / "tb")]) == 0
    acc = EventAccumulator(str(tmp_path / "tb" / "r"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    loss = [e.value for e in acc.Scalars("kpi/loss")]
    run = deepscope.open_run(run_path)
    np.testing.assert_allclose(loss, run.kpis("loss")["value"], rtol=1e-6)
    assert acc.Scalars("quantity/GradNorm")[0].value == pytest.approx(1.5)
    assert [e.step for e in acc.Scalars("h1/grad/norm")] == [0, 2]
    assert "hist/GradHist1d" in tags["histograms"]
    assert acc.Scalars("hist/GradHist1d/underflow")[0].value == 3


def test_export_needs_a_target(run_path, capsys):
    assert cli(["export", str(run_path)]) == 2
    assert "--tensorboard DIR" in capsys.readouterr().err


def test_nan_kpi_survives(tmp_path):
    with deepscope.Scope(tmp_path, "n", schedule=None) as scope:
        with scope.step(0) as rec:
            rec.kpi("loss", torch.tensor(float("nan")))
    assert np.isnan(deepscope.open_run(tmp_path / "n").kpis("loss")["value"][0])


@pytest.mark.parametrize("option", ["--parquet", "--tensorboard"])
def test_export_onto_a_file_is_one_line_naming_the_option(run_path, tmp_path, capsys, option):
    (tmp_path / "x.png").write_bytes(b"an image")
    assert cli(["export", str(run_path), option, str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{option} {tmp_path / 'x.png'}: that is a file" in err and "Errno" not in err
    assert (tmp_path / "x.png").read_bytes() == b"an image"


def test_ls_marks_a_cut_kinds_column(tmp_path, capsys):
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        for step in range(4):
            with scope.step(step, kind=f"kind_{step:02d}") as rec:
                rec.tensor("x", torch.ones(2), role="input")
    assert cli(["ls", str(tmp_path)]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert "kind_00,kind_01,kin… " in row


def test_tensorboard_export_of_a_histogram_recorded_as_missing(run_path, tmp_path):
    """A GradHist1d that could not be computed at a step is left out of the events (its
    reason stays in the run), and the export of the rest succeeds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with deepscope.Scope(run_path.parent, "m", schedule=deepscope.never) as scope:
        scope.writer.submit_quantities([
            QuantityValue("GradHist1d", 0, "", None, np.array([2, 1], dtype=np.int64),
                          {"edges": [-1.0, 1.0, 2], "nan": 0}),
            QuantityValue("GradHist1d", 1, "", None, meta={"reason": "batch of one"})])
    run = deepscope.open_run(run_path.parent / "m")
    with pytest.raises(KeyError, match="recorded as missing: batch of one"):
        run.histogram("GradHist1d", 1)
    missing = run.histogram("GradHist1d", 1, missing_ok=True)
    assert missing.missing and missing.reason == "batch of one" and missing.edges == ()
    stored = run.histogram("GradHist1d", 0)
    counts, meta = stored  # still unpacks as before
    assert counts.tolist() == [2, 1] and stored.edges[0].tolist() == [-1.0, 0.0, 1.0]
    assert stored.extras == {"nan": 0} and meta["edges"] == [-1.0, 1.0, 2]
    assert cli(["export", str(run_path.parent / "m"), "--tensorboard", str(tmp_path / "tb")]) == 0
    acc = EventAccumulator(str(tmp_path / "tb" / "m"))
    acc.Reload()
    assert [e.step for e in acc.Histograms("hist/GradHist1d")] == [0]
