"""nn.Embedding(sparse=True) (sparse COO gradients, trained with SparseAdam or SGD) changes
no recorded value: every instrument quantity and the recorder's parameter gradients equal
those of the same model with a dense embedding (whose values the other tests check against
brute force). Before, the recorder failed on every step ("copy_() between dense and sparse",
the whole step unrecorded) and the curvature was missing ("reshape is not implemented for
sparse tensors").
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import deepscope

V = 12


class _Model(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 4, sparse=sparse)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)).mean(1))


def _train(tmp_path, sparse: bool, optimiser: str):
    torch.manual_seed(0)
    model = _Model(sparse)
    if optimiser == "sparse_adam":
        opts = [torch.optim.SparseAdam([model.emb.weight], lr=0.1),
                torch.optim.Adam(model.head.parameters(), lr=0.1)]
    else:
        opts = [torch.optim.SGD(model.parameters(), lr=0.5)]
    name = f"{optimiser}{sparse}"
    grads = []
    with deepscope.Scope(tmp_path, name, schedule=deepscope.every(1), instruments="full",
                         instrument_options={"curvature": "exact", "max_ev_every": 1}
                         ) as scope:
        scope.watch(model, optimizer=opts[0])
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, V, (5, 3), generator=g)
            y = torch.randint(0, 3, (5,), generator=g)
            with scope.step(step) as rec:
                losses = F.cross_entropy(model(ids), y, reduction="none")
                rec.loss(losses.mean(), per_sample=losses)
                for opt in opts:
                    opt.zero_grad()
                losses.mean().backward()
                grads.append({n: p.grad.to_dense().clone() for n, p in model.named_parameters()})
                for opt in opts:
                    opt.step()
    return deepscope.open_run(tmp_path / name), grads


def _check_recorded_grads(run, grads) -> None:
    stats = run.stats_wide(direction="grad")
    for step, step_grads in enumerate(grads):
        for name, grad in step_grads.items():
            rows = stats[(stats["tensor"] == name) & (stats["step"] == step)]
            assert len(rows) == 1, (name, step)
            assert rows["norm"].iloc[0] == pytest.approx(float(grad.norm()), rel=1e-6)
            assert rows["mean"].iloc[0] == pytest.approx(float(grad.mean()), rel=1e-5, abs=1e-7)


def test_sparse_embedding_changes_no_value(tmp_path) -> None:
    dense, _ = _train(tmp_path, False, "sgd")
    sparse, grads = _train(tmp_path, True, "sgd")
    want = dense.quantities().set_index(["name", "layer", "step"])
    got = sparse.quantities().set_index(["name", "layer", "step"])
    assert sorted(got.index) == sorted(want.index)
    for key, row in want.iterrows():
        value = got.loc[key, "value"]
        if math.isnan(row["value"]):
            assert math.isnan(value) and got.loc[key, "meta"] == row["meta"], key
        else:
            assert value == pytest.approx(row["value"], rel=1e-5, abs=1e-9), key
    _check_recorded_grads(sparse, grads)


def test_sparse_adam_records_every_value(tmp_path) -> None:
    """SparseAdam (no dense twin to compare with): the gradients recorded are the loop's,
    and every quantity has a value (α: but at the last step, which has no next one)."""
    run, grads = _train(tmp_path, True, "sparse_adam")
    _check_recorded_grads(run, grads)
    q = run.quantities()
    values = q[~q["name"].str.startswith("GradHist")]
    assert values["value"].map(math.isfinite).all(), values[~values["value"].map(math.isfinite)]
    assert set(values["step"][values["name"] == "Alpha"]) == {0, 1}
