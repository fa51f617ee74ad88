"""Live reading: a reader polls runs while writer processes record every step at full rate.

Two writers run side by side: one with on_full="block" (back-pressure) and one with
on_full="drop" and a tiny queue, so it drops steps. This process is the reader: it keeps a
`Run` open as the GUI does, and at every poll checks that each step it sees is whole, that
no rows of a partial (or dropped) step are visible and that steps never disappear. At the
end: the blocking writer stored every step; the dropping one stored exactly the steps it
did not drop (committed + dropped = all); both logged their KPIs on every step; neither
writer failed (a reader never locks a writer out).

    python -m tests.stress.live_read [--steps 60]

Prints one JSON line of figures; exit status 0 means no reader error and nothing partial.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import torch

import deepscope
import deepscope.query  # noqa: F401 - loaded before the writers start: polls time reads, not imports
from tests.stress import workload

LANES = {"block": {"on_full": "block", "queue_size": 4},
         "drop": {"on_full": "drop", "queue_size": 1}}
SEED = 7
TIMEOUT_S = 300.0


def writer_main(root: Path, lane: str, steps: int, fd: int) -> NoReturn:
    """Record `steps` steps as fast as possible, close, print what the writer did."""
    code = 3
    try:
        scope, model = workload.open_scope(root, lane, **LANES[lane])
        os.write(fd, b"ready\n")
        slowest = 0.0
        for step in range(steps):
            t = time.perf_counter()
            workload.train_step(scope, model, SEED, step)
            slowest = max(slowest, time.perf_counter() - t)
        scope.close()
        w = scope.writer
        report = {"committed": w.committed_steps, "dropped": w.dropped_steps,
                  "failed": w.failed, "slowest_step_s": round(slowest, 4)}
        os.write(fd, (json.dumps(report) + "\n").encode())
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which fails
        os.write(fd, f"error {type(exc).__name__}: {exc}\n".encode())
    os._exit(code)


def poll(run: deepscope.Run, lane: str, seen: set[int]) -> list[str]:
    """One reader poll of a live run: new steps whole, old steps still there, nothing partial."""
    steps = set(run.steps())
    problems = [f"{lane}: steps {sorted(seen - steps)} disappeared"] if seen - steps else []
    workload.check_steps(run, SEED, sorted(steps - seen))
    seen |= steps
    orphans = workload.orphan_steps(run.path / "rank0.sqlite")
    if orphans:
        problems.append(f"{lane}: a reader saw rows of partial steps: {orphans}")
    return problems


def stress(root: Path, steps: int) -> dict:
    children = {}
    for lane in LANES:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            writer_main(root, lane, steps, w)
        os.close(w)
        children[lane] = (pid, os.fdopen(r, "rb"))
    problems: list[str] = []
    for lane, (_, pipe) in children.items():
        if pipe.readline() != b"ready\n":  # the run exists with its schema from here on
            problems.append(f"{lane}: writer did not start")
    figures: dict = {"steps": steps, "polls": 0, "polls_during_writing": 0}
    seen: dict[str, set[int]] = {lane: set() for lane in LANES}
    runs = {lane: deepscope.open_run(root / lane) for lane in LANES}
    deadline = time.monotonic() + TIMEOUT_S
    exited: dict[str, int] = {}
    try:
        writing = True
        while writing and not problems and time.monotonic() < deadline:
            for lane, (pid, _) in children.items():
                if lane not in exited and os.waitpid(pid, os.WNOHANG)[0] == pid:
                    exited[lane] = pid
            writing = len(exited) < len(children)
            for lane, run in runs.items():
                try:
                    problems += poll(run, lane, seen[lane])
                except Exception as exc:  # noqa: BLE001 - any reader error fails the stress
                    problems.append(f"{lane}: reader error {type(exc).__name__}: {exc}")
            figures["polls"] += 1
            figures["polls_during_writing"] += writing
        for lane, (pid, pipe) in children.items():
            if lane not in exited:  # stopped early: do not wait for a writer that may hang
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            line = pipe.read().decode(errors="replace").strip()
            if not line.startswith("{"):
                problems.append(f"{lane}: writer: {line or 'no report'}")
                continue
            report = json.loads(line)
            figures[lane] = report
            problems += final_checks(runs[lane], lane, steps, report, seen[lane])
    finally:
        for run in runs.values():
            run.close()
    figures["problems"] = problems
    return figures


def final_checks(run: deepscope.Run, lane: str, steps: int, report: dict,
                 seen: set[int]) -> list[str]:
    """After the writer closed: the counts add up and every stored step is whole."""
    problems = poll(run, lane, seen)
    stored = run.steps()
    if report["failed"]:
        problems.append(f"{lane}: writer failed: {report['failed']}")
    if len(stored) != report["committed"] or report["committed"] + report["dropped"] != steps:
        problems.append(f"{lane}: {len(stored)} stored, {report['committed']} committed, "
                        f"{report['dropped']} dropped of {steps}")
    if lane == "block" and stored != list(range(steps)):
        problems.append(f"{lane}: stored steps {stored}")
    kpi_steps = sorted(set(run.kpis("loss")["step"]))
    if kpi_steps != list(range(steps)):
        problems.append(f"{lane}: KPIs of steps {sorted(set(range(steps)) - set(kpi_steps))} "
                        "missing")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="steps each writer records")
    p.add_argument("--root", type=Path, help="where the runs go (default: a temp folder)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # forked children must not inherit a running OpenMP pool
    with tempfile.TemporaryDirectory() as tmp:
        workload.warm_up(Path(tmp))
        figures = stress(args.root or Path(tmp), args.steps)
    print(json.dumps(figures))
    return 1 if figures["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
