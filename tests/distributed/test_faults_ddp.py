"""Failure safety of a distributed run through `Scope`: a rank killed mid-run (SIGKILL)
leaves the other rank's file intact and readable. One harness launch."""

from __future__ import annotations

import datetime
import os
import signal
from pathlib import Path

from tests.distributed.harness import launch
from tests.distributed.test_scope_ddp import batch

KILLED_AT = 3


def killed_rank(rank: int, world: int, out_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from deepscope import Scope

    # DDP on a group with a short timeout: a dead peer ends rank 0's step in seconds
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=10))
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                                  process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    error = None
    try:
        with Scope(Path(out_dir), "killed", schedule=1) as scope:
            scope.watch(ddp)
            for step in range(10):
                if rank == 1 and step == KILLED_AT:
                    scope.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                x, y = batch(rank, step)
                with scope.step(step) as rec:
                    losses = ((ddp(x) - y) ** 2).mean(1)
                    rec.loss(losses.mean(), per_sample=losses)
                    opt.zero_grad()
                    losses.mean().backward()
                    opt.step()
    except Exception as exc:  # DDP's all-reduce meets the dead peer
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error}


def test_a_killed_rank_leaves_the_other_ranks_file_readable(tmp_path):
    import deepscope

    survivor, killed = launch("tests.distributed.test_faults_ddp:killed_rank", tmp_path,
                              timeout=90)
    assert killed.returncode == -signal.SIGKILL
    assert survivor.check()["error"] is not None  # its training ended with an error ...
    run = deepscope.open_run(tmp_path / "killed")
    # ... and its file holds every step before the kill, closed as interrupted
    assert run.steps(rank=0) == list(range(KILLED_AT))
    assert run.status(rank=0).startswith("interrupted: ")
    assert run.status(rank=1) == "crashed"  # committed steps stay readable
    assert run.steps(rank=1) == list(range(KILLED_AT))
