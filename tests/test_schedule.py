"""Schedules (every form, per kind) and dynamic recording."""

from __future__ import annotations

import pytest
import torch

import deepscope
from deepscope.recorder.schedule import as_schedule


def test_every_at_log_spaced():
    assert [s for s in range(25) if deepscope.every(10)(s, "k")] == [0, 10, 20]
    assert [s for s in range(25) if deepscope.every(5, start=3)(s, "k")] == [3, 8, 13, 18, 23]
    assert [s for s in range(25) if deepscope.at([2, 7, 99])(s, "k")] == [2, 7]
    logs = [s for s in range(1001) if deepscope.log_spaced(per_decade=1)(s, "k")]
    assert logs == [0, 1, 10, 100, 1000]
    dense = [s for s in range(101) if deepscope.log_spaced(per_decade=4)(s, "k")]
    assert dense == [0, 1, 2, 3, 6, 10, 18, 32, 56, 100]


def test_per_kind_records_rare_kinds_regularly():
    sched = deepscope.per_kind(10)
    kinds = ["common"] * 30
    kinds[5] = kinds[25] = "rare"
    chosen = [(s, k) for s, k in enumerate(kinds) if sched(s, k)]
    assert chosen == [(0, "common"), (5, "rare"), (10, "common"), (20, "common"),
                      (25, "rare")]


def test_as_schedule_forms_and_errors():
    assert as_schedule(3)(6, "k") and not as_schedule(3)(7, "k")
    assert not as_schedule(None)(0, "k")
    assert as_schedule(lambda s, k: k == "x")(1, "x")
    with pytest.raises(TypeError, match="every"):
        as_schedule("often")
    with pytest.raises(ValueError, match="positive"):
        deepscope.every(0)


def _loop(scope, losses, kinds=None):
    for step, value in enumerate(losses):
        with scope.step(step, kind=(kinds or ["k"] * len(losses))[step]) as rec:
            rec.tensor("x", torch.full((2, 2), float(step)), role="input")
            rec.loss(torch.tensor(value))


def test_callable_schedule_by_kind_and_kpis_every_step(tmp_path):
    with deepscope.Scope(tmp_path, "r", schedule=lambda s, k: k == "long") as scope:
        _loop(scope, [1.0] * 6, kinds=["short", "long"] * 3)
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [1, 3, 5]
    assert run.kpis("loss")["step"].tolist() == list(range(6))   # KPIs on every step
    assert run.kinds() == ["long", "short"]


def test_dynamic_recording_keep_if_and_explicit_decisions(tmp_path):
    losses = [1.0, 1.0, 9.0, 1.0, 1.0, 1.0]
    spike = lambda rec: float(rec.loss_value) > 5  # noqa: E731
    with deepscope.Scope(tmp_path, "dyn", schedule=deepscope.at([0]), dynamic=1,
                         keep_if=spike) as scope:
        for step, value in enumerate(losses):
            with scope.step(step) as rec:
                rec.tensor("x", torch.ones(2, 2), role="input")
                rec.loss(torch.tensor(value))
                if step == 4:
                    rec.keep()
                if step == 0:
                    rec.discard()
    run = deepscope.open_run(tmp_path / "dyn")
    assert run.steps() == [2, 4]
    assert len(run.kpis("loss")) == 6
