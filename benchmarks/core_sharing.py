"""How much work on the other core slows training on this machine (issue #19's recorder).

    PYTHONPATH=src python benchmarks/core_sharing.py [--rounds 9] [--steps 100] [--json]

The recorder's writer summarises and commits beside training. Wherever that work runs (a
thread, a process, a lower priority), it costs the training thread if the machine's cores
share execution resources (SMT siblings, a shared power budget, caches). This measures it
without deepscope in the training loop: plain training steps of the benchmark MLP
(`workload.py`'s, one torch thread) in turns — alone, and while a background **process**
keeps one other core busy with a duty cycle like the writer's (`--busy` ms of work, `--idle`
ms of sleep): either the recorder's fused summaries of a step shaped like `recorder_loop.py`'s
(24 float32 tensors, 0.74 M values: "summaries"), or a `sum` over a 64 kB tensor that stays in
the core's own cache ("in-cache"). A process, not a thread: the GIL plays no part. Per turn,
CPU time of the training thread per step; the ratio is taken per round against the same
round's turn alone; `measure` returns the median and spread over the rounds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import build_model, make_batches, setup_plain  # noqa: E402 - this folder

LOADS = ("summaries", "in-cache")


def _summary_inputs() -> list[tuple[torch.Tensor, int | None]]:
    """(tensor, batch_dim) pairs shaped like one recorded step of `recorder_loop.py`'s MLP:
    parameters and their gradients, 4 activations and their gradients, the losses."""
    params = [((256, 784), None), ((256,), None), ((256, 256), None), ((256,), None),
              ((10, 256), None), ((10,), None)]
    batched = [((128, 256), 0)] * 6 + [((128, 10), 0)] * 2 + [((128,), 0)] * 2
    return [(torch.randn(shape), bd) for shape, bd in params * 2 + batched]


def _background(stop: Any, ready: Any, load: str, busy_s: float, idle_s: float) -> None:
    """Keep one core busy `busy_s`, idle `idle_s`, until `stop` is set."""
    from deepscope.recorder.fast import fused_summaries

    torch.set_num_threads(1)
    inputs = _summary_inputs()
    small = torch.randn(64, 256)  # 64 kB: stays in the core's own cache
    ready.set()
    while not stop.is_set():
        start = time.thread_time()
        while time.thread_time() - start < busy_s:
            if load == "summaries":
                fused_summaries(inputs, 4)
            else:
                small.sum(1)
        time.sleep(idle_s)


def _quantiles(values: list[float]) -> dict[str, float]:
    q = (statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1
         else [values[0]] * 3)
    return {"median": statistics.median(values), "q25": q[0], "q75": q[2],
            "min": min(values), "max": max(values)}


def measure(rounds: int = 9, steps: int = 100, busy_ms: float = 2.5,
            idle_ms: float = 1.5) -> dict[str, Any]:
    """Per load in `LOADS`: the training thread's CPU time per plain step with that load on
    another core, over the same round's time alone (`rounds` rounds of `steps` steps per
    turn). Returns {"alone_ms": median ms per step alone, "<load>": quantiles of the ratios}."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    setup = setup_plain(build_model("mlp"), "train", Path("."))
    batches = make_batches("mlp")
    done = 0

    def turn() -> float:
        nonlocal done
        start = time.thread_time()
        for _ in range(steps):
            setup.step(done, *batches[done % len(batches)])
            done += 1
        return (time.thread_time() - start) / steps

    turn()  # warm-up
    ctx = mp.get_context("fork")  # the background inherits this module (also when imported)
    alone: list[float] = []
    ratios: dict[str, list[float]] = {load: [] for load in LOADS}
    for _ in range(rounds):
        base = turn()
        alone.append(base)
        for load in LOADS:
            stop, ready = ctx.Event(), ctx.Event()
            proc = ctx.Process(target=_background,
                               args=(stop, ready, load, busy_ms / 1e3, idle_ms / 1e3))
            proc.start()
            try:
                ready.wait(60)
                ratios[load].append(turn() / base)
            finally:
                stop.set()
                proc.join(30)
    out: dict[str, Any] = {"rounds": rounds, "steps": steps, "busy_ms": busy_ms,
                           "idle_ms": idle_ms, "alone_ms": 1e3 * statistics.median(alone)}
    for load in LOADS:
        out[load] = _quantiles(ratios[load])
    return out


def describe(result: dict[str, Any]) -> str:
    """`measure`'s result as a few lines of text."""
    lines = [f"plain step alone: {result['alone_ms']:.3f} ms of training-thread CPU "
             f"({result['rounds']} rounds of {result['steps']} steps; the other core busy "
             f"{result['busy_ms']} ms, idle {result['idle_ms']} ms in turn)"]
    for load in LOADS:
        s = result[load]
        lines.append(f"with {load:9s} on another core: {s['median']:.2f}x [IQR {s['q25']:.2f}-"
                     f"{s['q75']:.2f}, range {s['min']:.2f}-{s['max']:.2f}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds (default 9)")
    parser.add_argument("--steps", type=int, default=100, help="steps per turn (default 100)")
    parser.add_argument("--busy", type=float, default=2.5, help="ms of work per cycle")
    parser.add_argument("--idle", type=float, default=1.5, help="ms of sleep per cycle")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.busy <= 0 or args.idle < 0:
        parser.error("--rounds and --steps must be >= 1, --busy > 0, --idle >= 0")
    result = measure(args.rounds, args.steps, args.busy, args.idle)
    print(json.dumps(result) if args.json else describe(result))
    return result


if __name__ == "__main__":
    main()
