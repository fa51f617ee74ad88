"""A mistyped name or an unrecorded step is a one-line error with "did you mean" / the
nearest steps, never an empty table (issue 21, item 2)."""

from __future__ import annotations

import pytest
import torch

import deepscope
from deepscope.suggest import did_you_mean
from tests.helpers import train_mlp


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("names")
    with deepscope.Scope(path, "r", schedule=deepscope.at([0, 10, 20]), instruments=["GradNorm"],
                         instrument_schedule=deepscope.at([10])) as scope:
        train_mlp(scope, steps=21)
    with deepscope.open_run(path / "r") as run:
        yield run


@pytest.mark.parametrize("call, message", [
    (lambda r: r.stats("outptu"), "unknown tensor 'outptu'; did you mean 'output'?"),
    (lambda r: r.stats_wide("outptu"), "did you mean 'output'?"),
    (lambda r: r.kpis("acuracy"), "unknown kpi 'acuracy'; did you mean 'accuracy'?"),
    (lambda r: r.quantities("GradNrom"),
     "unknown quantity 'GradNrom'; did you mean 'GradNorm'?"),
    (lambda r: r.quantities("GradNorm", layer="l1.wieght"), "did you mean 'l1.weight'"),
    (lambda r: r.values("outptu", 10), "unknown tensor 'outptu'; did you mean 'output'?"),
    (lambda r: r.values("output", 15), "step 15 was not recorded in run 'r'; nearest: 10, 20"),
    (lambda r: r.stats("output", step=25), "nearest: 20"),
])
def test_unknown_names_and_steps_say_what_exists(run, call, message) -> None:
    with pytest.raises(KeyError) as info:
        call(run)
    text = info.value.args[0]
    assert message in text and "\n" not in text


def test_gradient_is_accepted_as_direction(run) -> None:
    grad = run.stats("l1.weight", direction="grad")
    assert not grad.empty
    assert run.stats("l1.weight", direction="gradient").equals(grad)
    assert run.values("l1.weight", 10, direction="gradient").shape == (8,)
    with pytest.raises(ValueError, match="unknown direction 'grads'; did you mean 'grad'"):
        run.stats("l1.weight", direction="grads")


def test_known_but_untracked_quantity_is_an_empty_table(run) -> None:
    assert run.quantities("HessTrace").empty  # valid name, not tracked in this run
    assert not run.quantities("GradNorm", layer="l1.weight").empty


def test_did_you_mean_lists_what_is_known() -> None:
    assert did_you_mean("x", [], "kpi") == "unknown kpi 'x' (recorded: none)"
    assert "did you mean 'GradNorm'?" in did_you_mean("gradnorm", ["GradNorm"], "quantity")
    assert "... (2 more)" in did_you_mean("z", list("abcd"), "tensor", shown=2)


def test_instrument_typo_fails_at_scope_with_did_you_mean(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown quantity 'fulll'; did you mean 'full'?"):
        deepscope.Scope(tmp_path, "r", instruments="fulll")
    with pytest.raises(ValueError, match="did you mean 'GradNorm'"):
        deepscope.Scope(tmp_path, "r", instruments=["Alpha", "GradNrom"])
    assert not (tmp_path / "r").exists()  # nothing created for a refused configuration
