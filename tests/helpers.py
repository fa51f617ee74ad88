"""Small models and a training loop shared by the foundation tests; loading a benchmark
script as a module."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    """benchmarks/<name>.py loaded as module `name` (registered while in use: dataclasses and
    the fork of a background process look it up); `workload`, which it imports, is dropped
    afterwards so each test gets its own."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.modules.pop("workload", None)


class MLP3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, rec=None):
        h1 = torch.relu(self.l1(x))
        h2 = torch.relu(self.l2(h1))
        out = self.l3(h2)
        if rec is not None:
            rec.tensor("h1", h1)
            rec.tensor("h2", h2)
        return out


def edges(graph: dict) -> set[tuple[str, str]]:
    return {(e["source"], e["target"]) for e in graph["edges"]}


def train_mlp(scope, steps: int = 4, batch: int = 8) -> MLP3:
    model = MLP3()
    scope.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        record_step(scope, model, opt, step, torch.randn(batch, 6),
                    torch.randint(0, 3, (batch,)))
    return model


def record_step(scope, model: nn.Module, opt: torch.optim.Optimizer, step: int,
                x: torch.Tensor, y: torch.Tensor, kind: str = "default",
                accuracy: bool = True) -> None:
    """One SGD step of a classifier `model(x, rec)`, recording input, target, output and the
    loss with its per-sample losses (and the KPI "accuracy" if asked)."""
    with scope.step(step, kind=kind) as rec:
        rec.tensor("input", x, role="input")
        rec.tensor("target", y, role="target")
        out = model(x, rec)
        rec.tensor("output", out, role="output")
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        rec.loss(losses.mean(), per_sample=losses)
        opt.zero_grad()
        losses.mean().backward()
        opt.step()
        if accuracy:
            rec.kpi("accuracy", (out.argmax(1) == y).float().mean())
