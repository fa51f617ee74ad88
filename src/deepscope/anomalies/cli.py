"""`deepscope doctor RUN [--rank N] [--limit N]` (registered when the CLI starts)."""

from __future__ import annotations

import argparse

from ..cli.verbs import verb
from .doctor import report


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run folder (or a project folder: every run in it)")
    p.add_argument("--rank", type=int, default=0, help="process rank to read (default 0)")
    p.add_argument("--limit", type=int, default=10,
                   help="findings listed per detector (default 10)")


@verb("doctor", "name a run's likely bug (ranked diagnoses with evidence and a fix), then its "
      "anomalies (first NaN/Inf, spikes, dead units) and where to look", _doctor_args)
def doctor_cmd(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    print(report(args.run, rank=args.rank, limit=args.limit))
    return 0
