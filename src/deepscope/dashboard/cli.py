"""`deepscope plot RUN -o FILE` (registered when the CLI starts)."""

from __future__ import annotations

import argparse

from ..cli.verbs import verb


def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run folder (project/run)")
    p.add_argument("-o", "--output", default="cockpit.png",
                   help="image file to write; the suffix picks the format (default cockpit.png)")
    p.add_argument("--step", type=int, default=None,
                   help="show the run as it was at this step (default: the last)")
    p.add_argument("--dpi", type=int, default=100, help="resolution (default 100)")


@verb("plot", "draw a run's instrument dashboard (Cockpit's layout) into an image file",
      _plot_args)
def plot_cmd(args: argparse.Namespace) -> int:
    if args.dpi < 1:
        raise ValueError(f"--dpi must be a positive integer, got {args.dpi}")
    from .figure import plot_dashboard  # matplotlib loads only for this verb

    fig = plot_dashboard(args.run, step=args.step)
    fig.savefig(args.output, dpi=args.dpi)
    width, height = (fig.get_size_inches() * args.dpi).round().astype(int)
    print(f"wrote {args.output} ({width} x {height} pixels)")
    return 0
