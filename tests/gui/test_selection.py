"""Selector values always resolve to a valid selection (no browser)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepscope.gui.data import ProjectData
from deepscope.gui.selection import Request, nearest_index, resolve

from .conftest import STEPS


@pytest.fixture(scope="module")
def data(project: Path) -> ProjectData:
    return ProjectData(project)


def test_first_load_opens_the_newest_step_of_the_first_run_at_its_output(
        data: ProjectData) -> None:
    sel, choices = resolve(data, Request(), None)
    assert (sel.run, sel.kind, sel.step, sel.node, sel.tensor) == ("base", "train", STEPS - 1,
                                                                  "output", "output")
    assert sel.follow and choices.step_index == STEPS - 1 and "(latest)" in choices.step_label
    assert [o["value"] for o in choices.directions] == ["forward", "grad"]
    assert {o["value"] for o in choices.batches} == {"mean", "abs_max", "std", "sample:0",
                                                     "sample:1"}


def test_step_buttons_and_slider_move_and_clamp(data: ProjectData) -> None:
    first, _ = resolve(data, Request(), None)
    prev, _ = resolve(data, Request(trigger="step-prev"), first.as_dict())
    assert prev.step == STEPS - 2 and not prev.follow
    nxt, _ = resolve(data, Request(trigger="step-next"), first.as_dict())
    assert nxt.step == STEPS - 1                      # clamped at the newest step
    slid, _ = resolve(data, Request(trigger="step-slider", slider=999), prev.as_dict())
    assert slid.step == STEPS - 1
    clicked, _ = resolve(data, Request(trigger="over-steps", picked_step=2), prev.as_dict())
    assert clicked.step == 2


def test_invalid_combinations_relax_to_the_nearest_valid_one(data: ProjectData) -> None:
    start, _ = resolve(data, Request(), None)
    sel, _ = resolve(data, Request(run="nope", kind="nope", iteration=7, node="nope",
                                   direction="grad:nope", batch="sample:9"), start.as_dict())
    assert (sel.run, sel.kind, sel.iteration, sel.node) == ("base", "train", 0, "output")
    assert sel.direction == "grad"                    # "grad:<group>" falls back to "grad"
    assert sel.batch == "sample:1"                    # the last stored batch item
    sel, _ = resolve(data, Request(node="input", direction="grad"), start.as_dict())
    assert (sel.tensor, sel.direction) == ("input", "forward")   # inputs have no gradient


def test_parameters_have_no_batch_items_and_live_in_iteration_zero(
        data: ProjectData) -> None:
    sel, choices = resolve(data, Request(run="recurrent", trigger="run"), None)
    assert sel.kind == "len_2"
    picked, choices = resolve(data, Request(run="recurrent", iteration=1, trigger="graph",
                                            picked_node="cell"), sel.as_dict())
    assert picked.node == "cell" and picked.iteration == 1
    assert picked.tensor in ("cell.weight", "cell.bias")
    assert picked.record_iteration == 0               # parameters are recorded per step
    assert {o["value"] for o in choices.batches} == {"mean", "abs_max", "std"}
    assert "row" in choices.batches[0]["label"]


def test_changing_kind_keeps_the_nearest_step_and_role_in_node(data: ProjectData) -> None:
    sel, _ = resolve(data, Request(run="recurrent", trigger="run"), None)
    sel, _ = resolve(data, Request(run="recurrent", trigger="step-prev"), sel.as_dict())
    assert (sel.kind, sel.step) == ("len_2", 0)
    bias, _ = resolve(data, Request(run="recurrent", trigger="graph", picked_node="cell",
                                    tensor="cell.bias"), sel.as_dict())
    moved, choices = resolve(data, Request(run="recurrent", kind="len_3", trigger="kind",
                                           tensor="cell.bias"), bias.as_dict())
    assert moved.kind == "len_3" and moved.step == 1   # the len_3 step nearest to step 0
    assert moved.tensor == "cell.bias"
    assert [o["value"] for o in choices.iterations] == [0, 1, 2]


def test_nearest_index() -> None:
    assert nearest_index([0, 10, 20], 14) == 1
    assert nearest_index([0, 10, 20], 16) == 2
    assert nearest_index([0, 10, 20], -5) == 0
    assert nearest_index([0, 10, 20], None) == 2
