"""deepscope's cost in a 2-rank DistributedDataParallel job (gloo, CPU): `run.py`'s "ddp" group.

The same command line as `workload.py`; a spec `ddp:MODEL:MODE` runs on 2 ranks (two
processes of this script, one torch thread each), any other spec is `workload.py`'s::

    python benchmarks/ddp_overhead.py --steps 60 --warmup 10 --dir /tmp/b [--paired] \
        ddp:mlp:train ddp:mlp:economy deepscope:mlp:economy

MODE train: plain DDP training. MODE economy: `Scope(schedule=never, instruments="economy",
instrument_schedule=every step)` on the DDP model (the health check on, as by default), the
values over the global batch; with --paired, plain DDP steps of the same processes take
turns with it, 10 steps each, and come as plain_ms_median/_mean. Both ranks run a fixed
number of steps (--max-seconds does not apply: the ranks must stop together). Rank 0's
record is printed as one JSON line, with `collective_ms`: the median time per step spent in
deepscope's own collectives (waiting for the other rank included), and `collectives`: how
many it issued per step.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import workload
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

WORLD = 2
MODES = ("train", "economy")


class CollectiveClock:
    """Time and count of torch.distributed's Python all-reduce and broadcast calls: those of
    deepscope (DDP's gradient all-reduce runs inside its C++ reducer, not through them)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        for name in ("all_reduce", "broadcast"):
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed


def measure_rank(spec: str, steps: int, warmup: int, root: Path, paired: bool) -> dict:
    """One rank of a `ddp:` spec (after init_process_group): its record."""
    import deepscope

    _, model_name, mode = spec.split(":")
    if mode not in MODES:
        raise ValueError(f"bad spec {spec!r}: mode must be one of {', '.join(MODES)}")
    rank = dist.get_rank()
    clock = CollectiveClock()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(workload.build_model(model_name))
    opt = torch.optim.SGD(ddp.parameters(), lr=workload.LR)
    batches = workload.make_batches(model_name)
    batches = batches[rank::WORLD] or batches  # each rank its own micro-batches
    scope = None
    if mode == "economy":
        scope = deepscope.Scope(root / f"ddp-{model_name}-{mode}", "run", overwrite=True,
                                schedule=deepscope.never, instruments="economy",
                                instrument_schedule=lambda step, kind: True)
        scope.watch(ddp, optimizer=opt)
    done = 0
    times: dict[bool, list[float]] = {True: [], False: []}  # deepscope's turn? -> seconds
    spent: list[float] = []
    calls: list[int] = []

    def step(with_scope: bool, timed: bool) -> None:
        nonlocal done
        x, y = batches[done % len(batches)]
        before, count, start = clock.seconds, clock.calls, time.perf_counter()
        if with_scope:
            with scope.step(done) as rec:
                losses = F.cross_entropy(ddp(x), y, reduction="none")
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
        else:
            losses = F.cross_entropy(ddp(x), y, reduction="none")
            opt.zero_grad()
            losses.mean().backward()
            opt.step()
        elapsed = time.perf_counter() - start
        done += 1
        if timed:
            times[with_scope].append(elapsed)
            if with_scope:
                spent.append(clock.seconds - before)
                calls.append(clock.calls - count)

    ours = scope is not None
    turns = [ours] + ([False] if paired and ours else [])
    for _ in range(warmup):
        for t in turns:
            step(t, timed=False)
    block = workload.PAIRED_BLOCK if len(turns) > 1 else 1
    while len(times[ours]) < steps:  # a fixed count: both ranks stop at the same step
        for t in turns:  # who goes first alternates, as in workload.measure
            for _ in range(min(block, steps - len(times[ours])) if t == ours else block):
                step(t, timed=True)
        turns.reverse()
    start = time.perf_counter()
    if scope is not None:
        scope.close()
    close_s = time.perf_counter() - start
    mine = times[ours]
    record: dict = {"spec": spec, "ms_median": 1e3 * statistics.median(mine),
                    "ms_mean": 1e3 * statistics.fmean(mine), "steps": len(mine),
                    "warmup": warmup, "close_s": close_s,
                    "bytes": workload.dir_bytes(root / f"ddp-{model_name}-{mode}"),
                    "stored_steps": 0,
                    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    "versions": workload.versions("deepscope"), "world_size": WORLD}
    if times[False] and scope is not None:
        record.update(plain_ms_median=1e3 * statistics.median(times[False]),
                      plain_ms_mean=1e3 * statistics.fmean(times[False]))
    if spent:
        record.update(collective_ms=1e3 * statistics.median(spent),
                      collectives=statistics.median(calls))
    return record


def run_ranks(spec: str, args: list[str], timeout: float = 600) -> dict:
    """`spec` on WORLD fresh processes of this script; rank 0's record (or an error)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--rank-of", spec, *args],
        env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "RANK": str(rank), "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(WORLD)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return {"spec": spec, "error": f"timed out after {timeout:g} s"}
    for proc, (_, err) in zip(procs, outputs):
        if proc.returncode != 0:
            tail = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            return {"spec": spec, "error": f"rank failed: {tail[:300]}"}
    lines = [line for line in outputs[0][0].splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"spec": spec, "error": "no record"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank-of":  # one rank of run_ranks
        spec, rest = argv[1], argv[2:]
        import argparse

        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int, default=60)
        parser.add_argument("--warmup", type=int, default=10)
        parser.add_argument("--max-seconds", type=float, default=10)
        parser.add_argument("--dir", type=Path, required=True)
        parser.add_argument("--paired", action="store_true")
        args = parser.parse_args(rest)
        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        record = measure_rank(spec, args.steps, args.warmup, args.dir, args.paired)
        if dist.get_rank() == 0:
            print(json.dumps(record), flush=True)
        dist.destroy_process_group()
        return 0
    specs = [a for a in argv if ":" in a and not a.startswith("-")]
    options = [a for a in argv if a not in specs]
    others = [s for s in specs if not s.startswith("ddp:")]
    records = {}
    if others:  # workload.py's own specs, in this process
        out = subprocess.run([sys.executable, str(Path(workload.__file__)), *options, *others],
                             capture_output=True, text=True, check=False).stdout
        records.update((r["spec"], r) for r in map(json.loads, (
            line for line in out.splitlines() if line.startswith("{"))))
    for spec in specs:
        record = records.get(spec) or (run_ranks(spec, options) if spec.startswith("ddp:")
                                       else {"spec": spec, "error": "workload gave no record"})
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
