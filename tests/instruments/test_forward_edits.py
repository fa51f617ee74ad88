"""A forward that changes a parameter in place: nn.Embedding(max_norm=...) renormalises the
rows it reads before using them. θₜ is where the step's loss and gradients were evaluated
(after the renormalisation): UpdateSize is the optimiser's update from there and Distance is
measured between such points; α, whose end point the next forward moves off the update line,
is missing with the reason. Before, θₜ was read before the forward: UpdateSize and Distance
counted the renormalisation (270x the optimiser's update at the first step here) and α was
fitted on a line its end point was not on.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import deepscope

V = 12


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 4, max_norm=1.0)
        self.head = nn.Linear(4, 3)
        with torch.no_grad():
            self.emb.weight.mul_(3)  # most rows above max_norm: the first forward renorms

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)).mean(1))


def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + micro)
    return torch.randint(0, V, (5, 3), generator=g), torch.randint(0, 3, (5,), generator=g)


def _quantity(q, name: str, step: int, layer: str = ""):
    rows = q[(q["name"] == name) & (q["step"] == step) & (q["layer"] == layer)]
    assert len(rows) == 1, (name, step, layer)
    return float(rows["value"].iloc[0]), rows["meta"].iloc[0]


def test_max_norm_embedding_update_distance_and_alpha(tmp_path) -> None:
    torch.manual_seed(0)
    model = _Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    evaluated, stepped = [], []  # emb.weight after each forward, after each optimiser step
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.every(1),
                         instruments="economy") as scope:
        scope.watch(model, optimizer=opt)
        for step in range(3):
            ids, y = _batch(step)
            with scope.step(step) as rec:
                losses = F.cross_entropy(model(ids), y, reduction="none")
                evaluated.append(model.emb.weight.detach().clone())
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
                stepped.append(model.emb.weight.detach().clone())
    q = deepscope.open_run(tmp_path / "r").quantities()
    for step in range(3):
        update, _ = _quantity(q, "UpdateSize", step, "emb.weight")
        assert update == pytest.approx(float((stepped[step] - evaluated[step]).norm()), rel=1e-5)
        distance, _ = _quantity(q, "Distance", step, "emb.weight")
        assert distance == pytest.approx(float((evaluated[step] - evaluated[0]).norm()),
                                         rel=1e-5, abs=1e-6)
    for step in range(2):  # every forward here renormalises some row the update lengthened
        value, meta = _quantity(q, "Alpha", step)
        assert math.isnan(value) and "changed parameter 'emb.weight' in place" in meta["reason"]
    assert math.isfinite(_quantity(q, "GradNorm", 0, "emb.weight")[0])


def test_max_norm_embedding_between_micro_batches(tmp_path) -> None:
    """The second micro-batch renormalises other rows: the step's samples saw different
    parameters, so its α has no single start point."""
    torch.manual_seed(0)
    model = _Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.every(1),
                         instruments="economy") as scope:
        scope.watch(model, optimizer=opt)
        for step in range(2):
            with scope.step(step) as rec:
                opt.zero_grad()
                for micro in range(2):
                    ids, y = _batch(step, micro)
                    losses = F.cross_entropy(model(ids), y, reduction="none")
                    rec.loss(losses.mean() / 2, per_sample=losses)
                    (losses.mean() / 2).backward()
                opt.step()
    q = deepscope.open_run(tmp_path / "r").quantities()
    value, meta = _quantity(q, "Alpha", 0)
    assert math.isnan(value) and "between micro-batches" in meta["reason"]
