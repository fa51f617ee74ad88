"""A small project recorded with the real recorder, and a GUI server on a free local port."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import deepscope
from deepscope.instruments.base import InstrumentWarning, QuantityValue
from tests.helpers import record_step

STEPS = 6
# what a BatchNorm in train mode makes the instruments warn (stored with runs/base)
WARNING = InstrumentWarning(1, "BatchNorm1d 'bn'", ("GradNorm", "NormTest", "InnerTest"),
                            "in train mode: per-sample gradients are ill-defined")


class Net(nn.Module):
    """pre -> tanh -> out, with the hidden activation registered by name."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.out = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, rec: deepscope.StepRecorder) -> torch.Tensor:
        hidden = torch.tanh(self.pre(x))
        rec.tensor("hidden", hidden)
        return self.out(hidden)


def train_step(scope: deepscope.Scope, model: Net, opt: torch.optim.Optimizer, step: int,
               kind: str = "train") -> None:
    """One recorded step on a fresh random batch (the loss is the only KPI)."""
    record_step(scope, model, opt, step, torch.randn(4, 5), torch.randint(0, 3, (4,)), kind,
                accuracy=False)


def instrument_values(model: Net, step: int) -> list[QuantityValue]:
    """What an instrument suite would store: per-layer and total values, a histogram."""
    values = [QuantityValue("GradNorm", step, name, float(p.detach().norm()) * (step + 1))
              for name, p in model.named_parameters()]
    values += [QuantityValue("GradNorm", step, "", 1.0 / (step + 1)),
               QuantityValue("Distance", step, "", 0.1 * step),
               QuantityValue("UpdateSize", step, "", 0.01),
               QuantityValue("NormTest", step, "", 0.5), QuantityValue("InnerTest", step, "", 0.3),
               QuantityValue("OrthoTest", step, "", 0.2),
               QuantityValue("GradHist1d", step, "", None, np.arange(10, dtype=np.int64),
                             {"edges": [-1.0, 1.0, 10], "underflow": 0, "overflow": 1,
                              "nan": 0, "posinf": 0, "neginf": 0})]
    alpha = QuantityValue("Alpha", step, "", 0.25) if step else \
        QuantityValue("Alpha", step, "", None, meta={"reason": "needs the next step"})
    return values + [alpha]


def record_run(path: Path, run: str, steps: int = STEPS, lr: float = 0.1,
               instruments: bool = True) -> None:
    torch.manual_seed(len(run))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with deepscope.Scope(path, run=run, schedule=deepscope.every(1), max_samples=2) as scope:
        scope.watch(model)
        scope.note(f"{run}: lr={lr}")
        for step in range(steps):
            train_step(scope, model, opt, step)
            if instruments:
                scope.writer.submit_quantities(instrument_values(model, step))
        if instruments:
            scope.writer.submit_warnings([WARNING])


def record_recurrent(path: Path, run: str = "recurrent") -> None:
    """Two kinds of steps; each step unrolls `length` iterations of a recurrent cell."""
    torch.manual_seed(1)
    cell, head = nn.Linear(6, 3), nn.Linear(3, 1)
    params = [*cell.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    with deepscope.Scope(path, run=run, schedule=deepscope.every(1), max_samples=3) as scope:
        scope.watch(nn.ModuleDict({"cell": cell, "head": head}))
        for step, length in enumerate((2, 3, 2, 3)):
            x = torch.randn(5, length, 3)
            with scope.step(step, kind=f"len_{length}") as rec:
                h = torch.zeros(5, 3)
                for i in range(length):
                    with rec.iteration():
                        rec.tensor("input", x[:, i], role="input")
                        h = torch.tanh(cell(torch.cat([x[:, i], h], 1)))
                        rec.tensor("state", h)
                out = head(h).squeeze(1)
                rec.tensor("output", out, role="output")
                losses = out ** 2
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                losses.mean().backward()
                opt.step()


@pytest.fixture(scope="session")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/base (instruments, notes, KPIs), runs/other (another lr), runs/recurrent, and
    runs/zz-damaged (a rank file that is not a database)."""
    path = tmp_path_factory.mktemp("gui") / "runs"
    record_run(path, "base")
    record_run(path, "other", lr=0.5, instruments=False)
    record_recurrent(path)
    (path / "zz-damaged").mkdir()
    (path / "zz-damaged" / "rank0.sqlite").write_bytes(b"not a database " * 64)
    return path


def start_server(path: Path) -> tuple[str, object]:
    from deepscope.gui.server import make_server
    server = make_server(path, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/", server


@pytest.fixture(scope="module")
def gui_url(project: Path) -> Iterator[str]:
    url, server = start_server(project)
    yield url
    server.shutdown()
    server.server_close()
