"""Paired A/B of unrecorded steps: what a loop that calls `rec.tensor` ×5 and
`rec.loss(per_sample=)` every step costs on steps the schedule does not choose.

    PYTHONPATH=src python benchmarks/unrecorded_steps.py [--blocks 40] [--block 10]

MLP 784-256-256-10, batch 128, one torch thread, SGD. In one process, plain training and
each configuration (`anomalies=False`, the default `anomalies="check"`) take turns in blocks
of `--block` steps on models sharing the same parameter tensors; the order rotates every
round. Per block it records the median wall time and the median CPU time of this thread
(`time.thread_time`, less disturbed by other processes) per step; a configuration's ratio is
taken per round against the plain block of the same round. Prints, per configuration, the
median ratio and its spread (25th-75th percentile of the per-round ratios) for both clocks.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.nn import functional as F
from workload import _sharing_parameters  # this folder is on sys.path when run

import deepscope

NAMES = ("fc1", "h1", "fc2", "h2", "logits")


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def _plain(model: nn.Module):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        losses = F.cross_entropy(model(x), y, reduction="none")
        loss = losses.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step, lambda: None


def _scoped(model: nn.Module, root: str, anomalies: str | bool):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scope = deepscope.Scope(root, run=f"a-{anomalies}", schedule=deepscope.never,
                            anomalies=anomalies)
    scope.watch(model, optimizer=opt)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        with scope.step(i) as rec:
            h = x
            for k, layer in enumerate(model):
                h = layer(h)
                rec.tensor(NAMES[k], h)
            losses = F.cross_entropy(h, y, reduction="none")
            loss = losses.mean()
            rec.loss(loss, per_sample=losses)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return step, scope.close


def _spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.3f} [{q[0]:.3f}-{q[2]:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=40, help="rounds (default 40)")
    parser.add_argument("--block", type=int, default=10, help="steps per turn (default 10)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model()
    batches = [(torch.randn(128, 784), torch.randint(0, 10, (128,))) for _ in range(8)]
    with tempfile.TemporaryDirectory() as root:
        arms = {"plain": _plain(_sharing_parameters(model)),
                "anomalies=False": _scoped(_sharing_parameters(model), root, False),
                "anomalies='check'": _scoped(_sharing_parameters(model), root, "check")}
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in arms}
        order = list(arms)
        done = 0
        for rnd in range(args.blocks + 2):  # the first two rounds warm up
            for name in order:
                step = arms[name][0]
                wall, cpu = [], []
                for _ in range(args.block):
                    x, y = batches[done % len(batches)]
                    w0, c0 = time.perf_counter(), time.thread_time()
                    step(done, x, y)
                    cpu.append(time.thread_time() - c0)
                    wall.append(time.perf_counter() - w0)
                    done += 1
                if rnd >= 2:
                    times[name].append((statistics.median(wall), statistics.median(cpu)))
            order = order[1:] + order[:1]
        for _, close in arms.values():
            close()
    plain = times["plain"]
    print(f"plain step: wall {1e3 * statistics.median(w for w, _ in plain):.3f} ms, "
          f"cpu {1e3 * statistics.median(c for _, c in plain):.3f} ms")
    for name in order:
        if name == "plain":
            continue
        ratios_w = [w / p[0] for (w, _), p in zip(times[name], plain)]
        ratios_c = [c / p[1] for (_, c), p in zip(times[name], plain)]
        print(f"{name:18s} ratio to plain: wall {_spread(ratios_w)}  cpu {_spread(ratios_c)}"
              f"  (median [IQR] over {len(plain)} rounds of {args.block} steps)")


if __name__ == "__main__":
    main()
