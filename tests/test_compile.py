"""torch.compile'd models: watched through their eager module, hooked steps run eagerly, the
values equal the eager model's, and the other steps stay compiled."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch._dynamo.utils
from torch import nn
from torch.nn import functional as F

import deepscope

RECORDED = [0, 2]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def train(path: Path, run: str, model: nn.Module, steps: int = 6) -> deepscope.Run:
    """SGD steps; 0 and 2 record activations and every instrument (1 and 3: α's end points),
    4 and 5 nothing."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    schedule = deepscope.at(RECORDED)
    with deepscope.Scope(path, run, schedule=schedule, instruments="full",
                         instrument_schedule=schedule,
                         instrument_options={"curvature": "exact"}) as scope:
        model = scope.watch(model, optimizer=opt, activations=True)
        for step in range(steps):
            with scope.step(step) as rec:
                x = torch.randn(8, 4, generator=data)
                y = torch.randint(0, 3, (8,), generator=data)
                losses = F.cross_entropy(model(x), y, reduction="none")
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
    return deepscope.open_run(path / run)


def assert_same_recording(eager: deepscope.Run, compiled: deepscope.Run) -> None:
    want, got = eager.quantities(), compiled.quantities()
    assert len(want) > 50 and sorted(set(got["layer"])) == sorted(set(want["layer"]))
    both = want.merge(got, on=["step", "name", "layer"], how="outer", indicator=True)
    assert (both["_merge"] == "both").all()
    assert both["value_x"].notna().sum() > 40  # real numbers, not all missing
    np.testing.assert_allclose(both["value_y"], both["value_x"], rtol=1e-5, atol=1e-7)
    for step in RECORDED:
        assert compiled.graph(step)["nodes"] == eager.graph(step)["nodes"]
    assert [n["id"] for n in compiled.graph(0)["nodes"] if n["role"] == "activation"] == \
        ["0", "1", "2"]  # submodule nodes, named as in the eager model
    pd.testing.assert_frame_equal(compiled.stats_wide(), eager.stats_wide(), rtol=1e-5,
                                  atol=1e-7)
    assert compiled.warnings().empty


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_model_records_what_the_eager_model_does(tmp_path: Path,
                                                            backend: str) -> None:
    eager = train(tmp_path, "eager", net())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled_model = torch.compile(net(), backend=backend)
    compiled = train(tmp_path, "compiled", compiled_model)
    assert_same_recording(eager, compiled)
    # the unrecorded steps ran compiled: one graph, compiled once, never recompiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert dict(torch._dynamo.utils.counters["frames"]) == {"total": 1, "ok": 1}


def test_a_model_compiled_after_watch_runs_eagerly_on_hooked_steps(tmp_path: Path) -> None:
    eager = train(tmp_path, "eager", net())
    torch._dynamo.reset()
    model = net()
    model.compile(backend="aot_eager")  # in place: no _orig_mod wrapper
    assert_same_recording(eager, train(tmp_path, "compiled", model))


def test_inductor(tmp_path: Path) -> None:
    eager = train(tmp_path, "eager", net())
    torch._dynamo.reset()
    assert_same_recording(eager, train(tmp_path, "compiled", torch.compile(net())))
