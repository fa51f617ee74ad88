"""Paired A/B of the recorder on every step: what recording costs the MLP loop of issue #19.

    PYTHONPATH=src python benchmarks/recorder_loop.py [--rounds 7] [--block 10] [--json]

MLP 784-256-256-10, batch 128, one torch thread, SGD. The recorded loop: `Scope(schedule=
every(1), max_samples=4)`, `watch(model, optimizer=opt)` (parameters and their gradients),
4 named activations via `rec.tensor` (fc1, h1, h2, logits) and `rec.loss(per_sample=)`;
each turn ends with `scope.flush()` (the writer drained), so the writer's work is in the
turn's time. In one process, plain training and the recorded loop take turns of `--block`
steps on models sharing the same parameter tensors, the first turn of each round
alternating. Per turn: wall time per step, CPU time of the training thread per step
(`time.thread_time`) and CPU time of the whole process per step (`time.process_time`: the
training thread, the writer thread and whatever else summarises). The ratio is taken per
round against the plain turn of the same round; `measure` returns the median and the spread
(min and max, and the 25th-75th percentiles) over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import _sharing_parameters  # noqa: E402 - this folder, put on sys.path above

import deepscope  # noqa: E402

NAMED = {0: "fc1", 1: "h1", 3: "h2", 4: "logits"}  # MLP layer index -> registered name
TARGET = 2.0  # issue #19: recording every step of this loop costs at most 2x a plain step


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def _plain(model: nn.Module) -> tuple[Callable[[int, torch.Tensor, torch.Tensor], None],
                                      Callable[[], None], Callable[[], None]]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        losses = F.cross_entropy(model(x), y, reduction="none")
        opt.zero_grad()
        losses.mean().backward()
        opt.step()
    return step, lambda: None, lambda: None


def _recorded(model: nn.Module, root: str):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scope = deepscope.Scope(root, run="recorder-loop", schedule=deepscope.every(1),
                            max_samples=4)
    scope.watch(model, optimizer=opt)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        with scope.step(i) as rec:
            h = x
            for k, layer in enumerate(model):
                h = layer(h)
                if k in NAMED:
                    rec.tensor(NAMED[k], h, role="output" if k == 4 else "activation")
            losses = F.cross_entropy(h, y, reduction="none")
            loss = losses.mean()
            rec.loss(loss, per_sample=losses)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return step, scope.flush, scope.close


def _summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q25": q[0], "q75": q[2],
            "min": min(values), "max": max(values)}


def measure(rounds: int = 7, block: int = 10, warmup_rounds: int = 2) -> dict[str, object]:
    """Run `rounds` timed rounds (after `warmup_rounds`), each a turn of `block` plain steps
    and a turn of `block` recorded steps (writer drained); return per-step milliseconds of the
    plain turns and, per clock ("wall", "thread", "process"), the summary of the per-round
    ratios recorded / plain."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model()
    batches = [(torch.randn(128, 784), torch.randint(0, 10, (128,))) for _ in range(8)]
    clocks = {"wall": time.perf_counter, "thread": time.thread_time,
              "process": time.process_time}
    with tempfile.TemporaryDirectory() as root:
        arms = {"plain": _plain(_sharing_parameters(model)),
                "recorded": _recorded(_sharing_parameters(model), root)}
        times: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
        order, done = list(arms), 0
        try:
            for rnd in range(rounds + warmup_rounds):
                for name in order:
                    step, drain, _ = arms[name]
                    start = {c: f() for c, f in clocks.items()}
                    for _ in range(block):
                        x, y = batches[done % len(batches)]
                        step(done, x, y)
                        done += 1
                    drain()
                    if rnd >= warmup_rounds:
                        times[name].append({c: (f() - start[c]) / block
                                            for c, f in clocks.items()})
                order.reverse()
        finally:
            for _, _, close in arms.values():
                close()
    plain, rec = times["plain"], times["recorded"]
    out: dict[str, object] = {
        "rounds": rounds, "block": block, "target": TARGET,
        "plain_ms": {c: 1e3 * statistics.median(t[c] for t in plain) for c in clocks},
        "recorded_ms": {c: 1e3 * statistics.median(t[c] for t in rec) for c in clocks}}
    for c in clocks:
        out[f"ratio_{c}"] = _summary([r[c] / p[c] for r, p in zip(rec, plain)])
    return out


def describe(result: dict[str, object]) -> str:
    """The result as a few lines of text."""
    lines = [f"plain step: {result['plain_ms']['wall']:.3f} ms wall "  # type: ignore[index]
             f"({result['rounds']} rounds of {result['block']} steps, writer drained per turn)"]
    for c in ("wall", "thread", "process"):
        s = result[f"ratio_{c}"]
        lines.append(f"recorded / plain, {c:7s}: {s['median']:.2f}x "  # type: ignore[index]
                     f"[IQR {s['q25']:.2f}-{s['q75']:.2f}, range {s['min']:.2f}-"  # type: ignore[index]
                     f"{s['max']:.2f}]  (target {TARGET}x wall)")  # type: ignore[index]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7, >= 5)")
    parser.add_argument("--block", type=int, default=10, help="steps per turn (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.block < 1:
        parser.error("--rounds and --block must be >= 1")
    result = measure(args.rounds, args.block)
    print(json.dumps(result) if args.json else describe(result))
    return result


if __name__ == "__main__":
    main()
