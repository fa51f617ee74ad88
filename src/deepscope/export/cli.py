"""`deepscope export RUN --tensorboard DIR | --parquet DIR`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cli.verbs import verb
from ..query.run import Run
from .parquet import export_parquet
from .tensorboard import export_tensorboard


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run folder, e.g. runs/baseline")
    p.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard event files here")
    p.add_argument("--parquet", metavar="DIR", help="write one Parquet file per table here")


@verb("export", "export a run to TensorBoard event files or Parquet tables", _args,
      extra="export")
def export(args: argparse.Namespace) -> int:
    if not (args.tensorboard or args.parquet):
        raise ValueError("say where to export: --tensorboard DIR and/or --parquet DIR")
    for option, folder in (("--tensorboard", args.tensorboard), ("--parquet", args.parquet)):
        if folder and Path(folder).exists() and not Path(folder).is_dir():
            raise ValueError(f"{option} {folder}: that is a file; {option} takes a folder "
                             "(new or existing) to write into")
    with Run(args.run) as run:
        if args.tensorboard:
            print(f"TensorBoard events in {export_tensorboard(run, args.tensorboard)}")
        if args.parquet:
            paths = export_parquet(run, args.parquet)
            print(f"{len(paths)} Parquet tables in {args.parquet}")
    return 0
