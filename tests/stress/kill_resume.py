"""Crash safety: `kill -9` training processes that record every step, at random moments.

Several lanes run side by side; each lane is one run folder that one writer process at a time
records into with `resume=True`. A writer prints `ok <step>` after `scope.flush()` returned,
i.e. once the step is committed. After every kill the run must open, hold every step any of
its writers reported, each of them whole (see `workload.check_step`), with no rows of a
partial step; and the next writer must continue right after the last step on disk. Some
kills land while the writer is still opening the run, most while it trains.

    python -m tests.stress.kill_resume [--kills 24] [--lanes 4] [--max-delay 0.6] [--seed 0]

Prints one JSON line of figures; exit status 0 means nothing was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch

import deepscope
from tests.stress import workload

EARLY_KILL_SHARE = 0.25   # kills aimed at the first moments of a writer (opening the run)
START_TIMEOUT_S = 120.0   # a writer that cannot start this long is a failure, not load


@dataclass
class Lane:
    """One run folder and what its writers reported so far."""

    index: int
    root: Path
    reported: set[int] = field(default_factory=set)
    verified: set[int] = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"lane{self.index}"

    @property
    def file(self) -> Path:
        return self.root / self.name / "rank0.sqlite"


@dataclass
class Writer:
    """A forked writer process and the bytes it printed."""

    lane: Lane
    pid: int
    fd: int
    forked: float
    kill_at: float | None = None
    out: bytes = b""
    killed: bool = False


def say(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def writer_main(lane: Lane, fd: int, steps: int | None) -> NoReturn:
    """Body of a forked writer: record until killed (or `steps` steps, then close cleanly)."""
    code = 3
    try:
        scope, model = workload.open_scope(lane.root, lane.name)
        first = workload.next_step(scope)
        say(fd, f"start {first}")
        parent = os.getppid()
        for step in range(first, first + (steps or 10**9)):
            if os.getppid() != parent:  # orphaned: the stress driver died
                break
            workload.train_step(scope, model, lane.index, step)
            scope.flush()
            if scope.writer.failed:
                say(fd, f"error writer failed: {scope.writer.failed}")
                break
            say(fd, f"ok {step}")
        else:
            scope.close()
            code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which fails
        say(fd, f"error {type(exc).__name__}: {exc}")
    os._exit(code)  # no atexit handlers: a forked child must not close the parent's state


def fork_writer(lane: Lane, steps: int | None = None) -> Writer:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        writer_main(lane, w, steps)
    os.close(w)
    return Writer(lane, pid, r, time.monotonic())


def read_some(writer: Writer) -> bool:
    """Read what is available; False at end of file."""
    chunk = os.read(writer.fd, 65536)
    writer.out += chunk
    return bool(chunk)


def run_round(lanes: list[Lane], rng: random.Random, max_delay: float) -> list[Writer]:
    """Start one writer per lane and kill each at a random moment; return them, dead."""
    writers = [fork_writer(lane) for lane in lanes]
    for w in writers:
        if rng.random() < EARLY_KILL_SHARE:
            w.kill_at = w.forked + rng.uniform(0.0, 0.05)
    while not all(w.killed for w in writers):
        now = time.monotonic()
        for w in writers:
            if not w.killed and w.kill_at is not None and now >= w.kill_at:
                os.kill(w.pid, signal.SIGKILL)
                w.killed = True
            elif not w.killed and now - w.forked > START_TIMEOUT_S:
                os.kill(w.pid, signal.SIGKILL)
                w.killed = True
                w.out += b"error no start line\n"
        waits = [w.kill_at - now for w in writers if not w.killed and w.kill_at is not None]
        live = [w for w in writers if not w.killed]
        timeout = max(0.0, min(waits, default=0.05))
        ready, _, _ = select.select([w.fd for w in live], [], [], timeout)
        for w in live:
            if w.fd in ready and not read_some(w):
                w.killed = True  # it ended by itself; waitpid below reports how
            if w.kill_at is None and b"start " in w.out:
                # Kill while it trains: a random point in the next `max_delay` seconds.
                w.kill_at = time.monotonic() + rng.uniform(0.0, max_delay)
    for w in writers:
        _, status = os.waitpid(w.pid, 0)
        while read_some(w):
            pass
        os.close(w.fd)
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            w.out += f"error exited with status {status} before the kill\n".encode()
    return writers


def parse(writer: Writer) -> tuple[int | None, list[int], list[str]]:
    """(first step, steps reported committed, error lines) from a writer's output."""
    start, oks, errors = None, [], []
    for line in writer.out.decode(errors="replace").splitlines():
        word, _, rest = line.partition(" ")
        if word == "start":
            start = int(rest)
        elif word == "ok":
            oks.append(int(rest))
        elif word == "error":
            errors.append(rest)
    return start, oks, errors


def verify(lane: Lane, before: int | None, start: int | None, oks: list[int],
           figures: dict[str, int]) -> list[str]:
    """Check the lane's run after a kill; return problems (empty: all good)."""
    lane.reported.update(oks)
    if not lane.file.exists():
        return [f"{lane.name}: steps {sorted(lane.reported)} reported, no file"] \
            if lane.reported else []
    try:
        run = deepscope.open_run(lane.file.parent)
        steps = run.steps()
    except deepscope.CorruptRunError as exc:
        # Only a run killed while its very first writer created the file may be unreadable.
        if lane.reported or before is not None:
            return [f"{lane.name}: unreadable after a kill: {exc}"]
        figures["unreadable_before_first_commit"] += 1
        return []
    try:
        problems = []
        lost = lane.reported - set(steps)
        if lost:
            problems.append(f"{lane.name}: committed steps {sorted(lost)} lost")
        if start is not None and start != (0 if before is None else before + 1):
            problems.append(f"{lane.name}: resumed at {start} after step {before}")
        new = [step for step in steps if step not in lane.verified]
        try:
            workload.check_steps(run, lane.index, new)
        except AssertionError as exc:
            problems.append(f"{lane.name}: {exc}")
        lane.verified.update(new)
        orphans = workload.orphan_steps(lane.file)
        if orphans:
            problems.append(f"{lane.name}: partial steps left behind: {orphans}")
        last = workload.last_any_step(run)
        if last is not None and last not in lane.reported:
            figures["kills_mid_step"] += 1  # killed with a step (partly) committed, unreported
        return problems
    finally:
        run.close()


def last_step_on_disk(lane: Lane) -> int | None:
    if not lane.file.exists():
        return None
    try:
        with deepscope.open_run(lane.file.parent) as run:
            return workload.last_any_step(run)
    except deepscope.CorruptRunError:
        return None


def stress(root: Path, kills: int, lanes_n: int, max_delay: float, seed: int) -> dict:
    rng = random.Random(seed)
    lanes = [Lane(i, root) for i in range(lanes_n)]
    figures = {"kills": 0, "lanes": lanes_n, "unreadable_before_first_commit": 0,
               "kills_mid_step": 0, "kills_during_open": 0}
    problems: list[str] = []
    while figures["kills"] < kills:
        before = {lane.index: last_step_on_disk(lane) for lane in lanes}
        for w in run_round(lanes, rng, max_delay):
            figures["kills"] += 1
            start, oks, errors = parse(w)
            figures["kills_during_open"] += start is None
            problems += [f"{w.lane.name}: writer: {e}" for e in errors]
            problems += verify(w.lane, before[w.lane.index], start, oks, figures)
        if problems:
            break
    # A last writer per lane resumes once more and closes cleanly.
    for lane in lanes:
        before = last_step_on_disk(lane)
        w = fork_writer(lane, steps=3)
        _, status = os.waitpid(w.pid, 0)
        while read_some(w):
            pass
        os.close(w.fd)
        start, oks, errors = parse(w)
        problems += [f"{lane.name}: final writer: {e}" for e in errors]
        if status != 0 or len(oks) != 3:
            problems.append(f"{lane.name}: final writer status {status}, steps {oks}")
        problems += verify(lane, before, start, oks, figures)
    figures["steps_reported"] = sum(len(lane.reported) for lane in lanes)
    figures["steps_verified"] = sum(len(lane.verified) for lane in lanes)
    figures["problems"] = problems
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=24)
    p.add_argument("--lanes", type=int, default=4, help="writer processes side by side")
    p.add_argument("--max-delay", type=float, default=0.6,
                   help="seconds a writer trains at most before its kill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", type=Path, help="where the runs go (default: a temp folder)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # forked children must not inherit a running OpenMP pool
    with tempfile.TemporaryDirectory() as tmp:
        workload.warm_up(Path(tmp))
        figures = stress(args.root or Path(tmp), args.kills, args.lanes, args.max_delay,
                         args.seed)
    print(json.dumps(figures))
    return 1 if figures["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
