"""What curvature="auto" costs per step, against a plain training step and a fixed estimator.

Trains a small CNN (2,458 parameters, the kind of model issue 14 measured) and a tiny MLP
(12 parameters) for a few steps with HessTrace and TICDiag, once per curvature mode, and
prints per mode the median seconds of an instrumented step, the estimator used and "auto"'s
reason. `--exact` also times curvature="exact" on the CNN (one HVP per parameter: minutes on
a busy CPU).

Run:  python benchmarks/curvature_choice.py [--steps 4] [--exact]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from deepscope.instruments.suite import Instruments


def cnn() -> nn.Module:
    """2,458 parameters; one HVP costs several of its training steps (the test uses it too)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))


def measure(make: type, shape: tuple[int, ...], classes: int, mode: str | None,
            steps: int) -> tuple[float, str, str]:
    """(median seconds per step, estimator, choice) with instruments; mode None: plain."""
    torch.manual_seed(0)
    model = make()
    x, y = torch.randn(32, *shape), torch.randint(0, classes, (32,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    inst = None if mode is None else Instruments(model, ["HessTrace", "TICDiag"],
                                                 optimizer=opt, curvature=mode)
    times, meta = [], {}
    for step in range(steps + 1):  # the first step warms up and is not counted
        began = time.perf_counter()
        if inst is not None:
            inst.start(step, "train")
        losses = F.cross_entropy(model(x), y, reduction="none")
        if inst is not None:
            inst.loss(losses.mean(), per_sample=losses)
        opt.zero_grad()
        losses.mean().backward()
        opt.step()
        if inst is not None:
            meta = next(v.meta for v in inst.finish() if v.name == "HessTrace" and v.layer == "")
        if step:
            times.append(time.perf_counter() - began)
    return statistics.median(times), meta.get("estimator", "-"), meta.get("choice", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--exact", action="store_true", help="also time exact on the CNN")
    args = parser.parse_args()
    cases = [("cnn (2,458 parameters)", cnn, (1, 16, 16), 10),
             ("mlp (12 parameters)", mlp, (2,), 2)]
    for label, make, shape, classes in cases:
        modes = [None, "auto", "hutchinson"]
        if args.exact or make is mlp:
            modes.append("exact")
        for mode in modes:
            seconds, estimator, choice = measure(make, shape, classes, mode, args.steps)
            print(f"{label:24} {mode or 'plain':>10}: {seconds * 1e3:10.2f} ms/step  "
                  f"{estimator:10} {choice}")


if __name__ == "__main__":
    main()
