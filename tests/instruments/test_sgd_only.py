"""CABS and EarlyStopping assume plain SGD (Cockpit refuses other optimisers): the native
API computes them and says so in the stored note and in the instruments' warnings."""

from __future__ import annotations

import pytest
import torch

import deepscope
from deepscope.instruments.suite import is_plain_sgd


def _record(path, make_opt):
    model = torch.nn.Linear(3, 2)
    opt = make_opt(model.parameters())
    scope = deepscope.Scope(path, "run", schedule=deepscope.never,
                            instruments=["CABS", "EarlyStopping"],
                            instrument_schedule=deepscope.every(1), anomalies=False)
    scope.watch(model, optimizer=opt)
    for step in range(2):
        x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        with scope.step(step) as rec:
            opt.zero_grad()
            losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            rec.loss(losses.mean(), per_sample=losses)
            losses.mean().backward()
            opt.step()
    warned = list(scope.instruments.warnings)
    scope.close()
    with deepscope.open_run(scope.run_dir) as run:
        table = run.quantities()
        assert sorted(run.warnings()["message"]) == sorted(warned)  # stored in the run too
    return table[table["layer"] == ""], warned


def test_other_optimizers_are_named_in_the_note_and_warned(tmp_path):
    with pytest.warns(deepscope.DeepscopeWarning, match="EarlyStopping assumes plain SGD"):
        table, warned = _record(tmp_path, lambda p: torch.optim.Adam(p, lr=0.01))
    for name in ("CABS", "EarlyStopping"):
        notes = [m.get("note", "") for m in table[table["name"] == name]["meta"]]
        assert len(notes) == 2 and all(f"{name} assumes plain SGD" in n and "Adam" in n
                                       for n in notes)
        assert sum(f"{name} assumes plain SGD" in w for w in warned) == 1  # once
    assert table["value"].notna().all()


def test_plain_sgd_has_no_note(tmp_path):
    table, warned = _record(tmp_path, lambda p: torch.optim.SGD(p, lr=0.1))
    assert not [m for m in table["meta"] if "note" in m] and not warned


@pytest.mark.parametrize("kwargs, plain", [({}, True), ({"momentum": 0.9}, False),
                                           ({"weight_decay": 1e-4}, False),
                                           ({"momentum": 0.9, "nesterov": True}, False)])
def test_is_plain_sgd(kwargs, plain):
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert is_plain_sgd(torch.optim.SGD(params, lr=0.1, **kwargs)) is plain
    assert not is_plain_sgd(torch.optim.Adam(params))
