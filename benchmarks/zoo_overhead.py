"""Step time of each zoo model (tests/zoo) with deepscope against plain training.

For every model: plain training, then `activations=True` with instruments "economy" and
"full" (curvature by Hutchinson with the default probes: "auto" picks the exact diagonal on
models this small, see docs/LIMITATIONS.md), every step recorded, all in one process and
interleaved over the repeats so that the plain step is measured next to what it is compared
with. Prints one line per model: median seconds per step and the ratios to plain.

Run:  PYTHONPATH=src:. python benchmarks/zoo_overhead.py [--steps 6] [--repeats 3] [names]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import deepscope
from tests.zoo.harness import build, train_step
from tests.zoo.test_zoo import CASES

CONFIGS = ("plain", "economy", "full")


def _time(case, config: str, steps: int, root: Path) -> float:
    """Median seconds per step after one warm-up step; every step recorded."""
    model, trained, opt = build(case)
    model.eval()  # deterministic, and BatchNorm / Dropout take their per-sample-exact path
    times: list[float] = []
    batches = [case.batch(0, m) for m in range(case.micro_batches)]
    if config == "plain":
        for _ in range(steps + 1):
            t = time.perf_counter()
            train_step(case, trained, opt, batches)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])
    scope = deepscope.Scope(root, f"{case.name}-{config}-{time.monotonic_ns()}",
                            schedule=deepscope.every(1), instruments=config,
                            instrument_options={"curvature": "hutchinson"})
    with scope:
        scope.watch(trained, activations=True, optimizer=opt)
        for step in range(steps + 1):
            t = time.perf_counter()
            with scope.step(step) as rec:
                train_step(case, trained, opt, batches, rec)
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(CASES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"{'model':15} {'plain ms/step':>13} {'economy ms (x plain)':>21} "
          f"{'full ms (x plain)':>19}")
    with tempfile.TemporaryDirectory() as root:
        for name in args.names:
            runs: dict[str, list[float]] = {c: [] for c in CONFIGS}
            try:
                for r in range(args.repeats):
                    for config in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
                        runs[config].append(_time(CASES[name], config, args.steps, Path(root)))
            except Exception as exc:  # noqa: BLE001 - one line per model, the run goes on
                print(f"{name:15} error: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                continue
            ms = {c: 1e3 * statistics.median(runs[c]) for c in CONFIGS}
            cells = [f"{ms[c]:.1f} ({ms[c] / ms['plain']:.0f}x)" for c in CONFIGS[1:]]
            print(f"{name:15} {ms['plain']:13.2f} {cells[0]:>21} {cells[1]:>19}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
