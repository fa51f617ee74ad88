"""The GUI's data functions for distributed runs (issue 15, item 6), without a browser: the
spread strip's outlier, the ranks' status line, the graph comparison, and the statistics and
KPI charts per rank choice; a single-process run is left as it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import deepscope
from deepscope.gui import panels, ranks
from deepscope.gui.data import ProjectData
from deepscope.gui.tabs.kpis import kpi_charts

from .conftest import record_run
from .ranks_runs import STEPS, local_loss, local_norm, record_ranks

pytestmark = pytest.mark.filterwarnings("ignore::deepscope.DeepscopeWarning")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> ProjectData:
    path = tmp_path_factory.mktemp("ranks")
    record_ranks(path, "ddp")
    record_ranks(path, "odd", world=4, present=(0, 1, 2), bad=2, other_graph=2)
    record_run(path, "single", instruments=False)
    return ProjectData(path)


def local(values: dict[int, list[float]], name: str = "Loss") -> pd.DataFrame:
    """A `run.quantities(rank="all")` table of one quantity (layer "")."""
    return pd.DataFrame([(r, s, name, "", v) for r, vs in values.items()
                         for s, v in enumerate(vs)],
                        columns=["rank", "step", "name", "layer", "value"])


def test_the_rank_furthest_from_the_median_is_marked_only_when_it_stands_out() -> None:
    bad = ranks.spread(local({0: [1.0, 1.0], 1: [1.1, 0.9], 2: [5.0, 4.0], 3: [0.95, 1.0]}),
                       "Loss")
    # medians 1.05 and 1.0; rank 2 is (5-1.05)/1.05 and 3 off: mean 3.38, i.e. 338%
    assert bad.outlier == 2
    assert bad.summary == ("rank 2 is furthest from the median: 338% off on average, "
                           "376% at step 0")
    # ranks 0 and 2 equally far from rank 1 on either side: no outlier
    even = ranks.spread(local({0: [1.0], 1: [2.0], 2: [3.0]}), "Loss")
    assert even.outlier is None and even.summary.startswith("no rank stands out")
    # two ranks: their midpoint is the median, so neither is singled out; the gap is said
    two = ranks.spread(local({0: [1.0, 2.0], 1: [3.0, 2.0]}), "Loss")
    assert two.outlier is None
    assert two.summary == "ranks 0 and 1 differ by up to 100% of their mean (step 0, " \
                          "rank 1 higher)"
    # another quantity or a per-parameter layer is not mixed in
    table = pd.concat([local({0: [1.0], 1: [2.0]}, "GradNorm"),
                       local({0: [7.0], 1: [9.0]}).assign(layer="w")])
    assert ranks.spread(table, "Loss").table.empty


def test_status_line_names_each_rank_that_is_not_right() -> None:
    table = pd.DataFrame({"rank": [0, 1, 2, 3],
                          "status": ["finished", "crashed", "recording", "missing"],
                          "steps": [5, 3, 1, 0],
                          "last_step": pd.array([4, 2, 0, None], dtype="Int64"),
                          "problem": ["", "killed?", "", "no file rank3.sqlite"]})
    line, detail, bad = ranks.status_line(table, 4)
    assert bad
    assert line == "4 ranks · rank 1 crashed after step 2; rank 3 missing"
    assert detail == ("4 ranks\nrank 1 crashed after step 2: killed?\n"
                      "rank 3 missing: no file rank3.sqlite")
    assert ranks.status_line(table.iloc[[0, 2]], 2) == ("2 ranks", "2 ranks", False)


def test_rank_info_and_graph_comparison(project: ProjectData) -> None:
    assert ranks.rank_info(project.run("single")) is None
    assert ranks.query_rank(project.run("single"), "1") is None  # left as it was
    info = ranks.rank_info(project.run("odd"))
    assert (info["world"], info["ranks"], info["bad"]) == (4, [0, 1, 2], True)
    assert "rank 3 missing" in info["status"]
    assert ranks.graph_mismatch(project.run("odd"), 1, 0) == [2]
    assert ranks.graph_mismatch(project.run("ddp"), 1, 0) == []


def test_strip_draws_every_rank_and_the_global_batch(project: ProjectData) -> None:
    (loss, norm), lines = ranks.strip_panels(project.run("odd"), "global")
    assert [t["name"] for t in loss["data"]] == ["rank 0", "rank 1",
                                                 "rank 2 (furthest from median)",
                                                 "global batch"]
    for rank in (0, 1, 2):
        np.testing.assert_allclose(loss["data"][rank]["y"],
                                   [local_loss(rank, s, bad=2) for s in range(STEPS)])
        np.testing.assert_allclose(norm["data"][rank]["y"],
                                   [local_norm(rank, s) for s in range(STEPS)])
    assert loss["layout"]["meta"]["outlier"] == 2 and loss["data"][2]["line"]["width"] > 3
    assert norm["layout"]["meta"]["outlier"] is None
    assert "rank 2 is furthest from the median" in lines[0].children
    (chosen, _), _ = ranks.strip_panels(project.run("odd"), "1")
    assert [t.get("opacity") for t in chosen["data"][:3]] == [0.3, None, 0.3]
    # the gradient norm of the Instruments tab's layer, where the ranks recorded it
    (_, layer), _ = ranks.strip_panels(project.run("odd"), "global", "out.weight")
    assert layer["layout"]["title"]["text"] == "local gradient norm · out.weight"
    np.testing.assert_allclose(layer["data"][1]["y"], [local_norm(1, s) / 10
                                                       for s in range(STEPS)])
    np.testing.assert_allclose(layer["data"][3]["y"], [
        sum(local_norm(r, s) for r in (0, 1, 2)) / 30 for s in range(STEPS)])  # global
    (_, whole), _ = ranks.strip_panels(project.run("odd"), "global", "pre.weight")
    assert whole["layout"]["title"]["text"] == "local gradient norm"   # not per layer there


def test_statistics_over_steps_per_rank_choice(project: ProjectData) -> None:
    rd = project.run("ddp")
    sel = {"tensor": "output", "direction": "forward", "record_iteration": 0, "kind": "train",
           "step": 0}
    with deepscope.open_run(rd.run.path) as run:
        own = [run.stats_wide("output", direction="forward", rank=r)["norm"].to_numpy()
               for r in (0, 1)]
    merged = panels.history(project, ["ddp"], sel, "norm")
    assert [t["name"] for t in merged["data"]] == ["ddp"]
    assert merged["layout"]["title"]["text"].endswith("global batch (ranks merged)")
    np.testing.assert_allclose(merged["data"][0]["y"], np.hypot(*own), rtol=1e-6)
    one = panels.history(project, ["ddp"], sel, "norm", rank="1")
    np.testing.assert_allclose(one["data"][0]["y"], own[1], rtol=1e-6)
    both = panels.history(project, ["ddp", "single"], sel, "norm", rank="all")
    assert [t["name"] for t in both["data"]] == ["ddp · rank 0", "ddp · rank 1", "single"]
    # sv_max cannot be merged: the chart says so instead of drawing nothing unexplained
    sv = panels.history(project, ["ddp"], sel, "sv_max")
    assert "sv_max is not merged over ranks" in sv["layout"]["annotations"][0]["text"]


def test_statistics_table_per_rank_choice(project: ProjectData) -> None:
    rd = project.run("ddp")
    sel = {"run": "ddp", "tensor": "output", "direction": "forward", "record_iteration": 0,
           "step": 2, "batch": "mean"}
    _, table = panels.stats_table(rd, sel, "all")
    head = [th.children for th in table.children[1].children.children]
    assert head == ["statistic", "rank 0", "rank 1"]
    _, single = panels.stats_table(project.run("single"), {**sel, "run": "single"}, "all")
    assert "rank" not in single.children[0].children   # the caption: a single-process run


def test_kpis_per_rank(project: ProjectData) -> None:
    charts = kpi_charts(project, ["ddp", "single"], 0.0, "all")
    loss = next(c for c in charts if c.to_plotly_json()["props"].get("data-kpi") == "loss")
    names = [t["name"] for t in loss.children.figure["data"]]
    assert names == ["ddp · rank 0", "ddp · rank 1", "single"]


def test_warnings_of_several_ranks_are_shown_once_with_their_ranks() -> None:
    table = pd.DataFrame([(0, 1, "bn", ["GradNorm"], "train mode"),
                          (1, 2, "bn", ["GradNorm"], "train mode"),
                          (1, 3, "", ["Alpha"], "no next step")],
                         columns=["rank", "step", "location", "quantities", "message"])
    out = ranks.distinct_warnings(table, [0, 1])
    assert out.to_dict("records") == [
        {"step": 1, "location": "bn", "quantities": ["GradNorm"], "message": "train mode"},
        {"step": 3, "location": "rank 1", "quantities": ["Alpha"], "message": "no next step"}]
    assert ranks.distinct_warnings(table, [0, 1, 2])["location"].tolist() == [
        "ranks 0, 1 · bn", "rank 1"]


def test_health_findings_of_a_distributed_run_name_their_rank() -> None:
    from deepscope.gui.tabs.diagnosis import _findings
    found = pd.DataFrame([(1, 3, "train", "fc", "nan", 2.0, 0.0, "NaN in fc")],
                         columns=["rank", "step", "kind", "tensor", "detector", "value",
                                  "threshold", "message"])
    table = _findings("ddp", found)[1]
    assert [th.children for th in table.children[0].children.children][:2] == ["rank", "step"]
    assert [td.children for td in table.children[1].children[0].children][:2] == [1, 3]


def test_an_overlaid_run_without_the_chosen_rank_is_named_not_an_error(
        project: ProjectData) -> None:
    sel = {"tensor": "output", "direction": "forward", "record_iteration": 0, "kind": "train",
           "step": 0}
    fig = panels.history(project, ["odd", "ddp"], sel, "norm", rank="2")
    assert [t["name"] for t in fig["data"]] == ["odd · rank 2"]
    assert fig["layout"]["annotations"][0]["text"] == "not recorded in ddp (no rank 2)"


def test_a_merged_record_without_batch_dimension_says_when_it_is_one_ranks(
        project: ProjectData) -> None:
    """The loss differs between ranks and has no batch dimension: the global choice shows
    rank 0's record, and says so rather than passing it off as the global batch's."""
    rd = project.run("ddp")
    sel = {"run": "ddp", "tensor": "loss", "direction": "forward", "record_iteration": 0,
           "step": 1, "batch": "mean", "kind": "train"}
    _, table = panels.stats_table(rd, sel)
    assert "the ranks' records differ: this is rank 0's" in table.children[0].children
    fig = panels.history(project, ["ddp"], sel, "mean")
    assert "this is rank 0's" in fig["layout"]["annotations"][0]["text"]
    _, batched = panels.stats_table(rd, {**sel, "tensor": "output"})
    assert "differ" not in batched.children[0].children


def test_a_run_without_rank_0_still_says_which_ranks_it_has(tmp_path: Path) -> None:
    record_ranks(tmp_path, "r", present=(1,))
    info = ranks.rank_info(ProjectData(tmp_path).run("r"))
    assert (info["world"], info["ranks"], info["status"]) == (2, [1], "2 ranks · rank 0 missing")
