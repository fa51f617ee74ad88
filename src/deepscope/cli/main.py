"""`deepscope` — ls, serve, demo, plot, export, doctor. Each verb is a thin layer over the API."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..anomalies.cli import doctor_cmd
from ..dashboard.cli import plot_cmd
from ..demo.cli import demo
from ..errors import DeepscopeError
from ..export.cli import export
from ..gui.cli import serve_cmd
from ..query import Project, Run
from ..query.ranks import describe as describe_ranks
from ..store.layout import is_run_dir
from .text import SafeStream, clean
from .verbs import Verb, verb

__all__ = ["VERBS", "Verb", "build_parser", "main", "verb"]


def _ls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a project folder (folder of runs) or one run folder")


@verb("ls", "list runs with their steps and size on disk", _ls_args)
def ls(args: argparse.Namespace) -> int:
    path = Path(args.path)
    project = Project(path)
    names = project.runs()
    if not names:
        print(f"no runs in {path}")
        return 0
    print(f"{'run':<24} {'recorded':>9} {'first':>7} {'last':>7} {'kpi steps':>9} "
          f"{'kinds':<20} {'size':>9}")
    for name in names:
        run = Run(path if is_run_dir(path) else path / name)
        try:
            steps = run.steps()
            kpi_steps = run.kpis()["step"].nunique()
            kinds = clean(",".join(run.kinds()))  # a newline in a kind would forge a row
            first, last = (steps[0], steps[-1]) if steps else ("-", "-")
            print(f"{name:<24} {len(steps):>9} {first!s:>7} {last!s:>7} {kpi_steps:>9} "
                  f"{_cut(kinds, 20):<20} {_size(run.size_bytes()):>9}")
            if line := describe_ranks(run.manifest(), run.status):  # a distributed run
                print(f"  {clean(line)}")
        finally:
            run.close()
    return 0


def _cut(text: str, width: int) -> str:
    """`text` in at most `width` characters, an ellipsis marking a cut."""
    return text if len(text) <= width else text[:width - 1] + "…"


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


# Every verb, in the order `deepscope --help` lists them. Their modules import no optional
# extra (nor torch) at module level: each verb loads what it needs when it runs, so every
# verb is always listed and the command starts fast.
VERBS: tuple[Verb, ...] = (ls, serve_cmd, demo, plot_cmd, export, doctor_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepscope", description="See inside a PyTorch network while it trains.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for v in VERBS:
        p = sub.add_parser(v.name, help=v.help, description=v.help)
        v.configure(p)
        p.set_defaults(func=v)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Everything a verb prints passes through `clean`: names and texts come from run files.
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = SafeStream(stdout), SafeStream(stderr)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        if (exc.name or "deepscope").partition(".")[0] == "deepscope" or not args.func.extra:
            raise  # not an optional extra: a bug, with its traceback
        print(f"deepscope: error: `deepscope {args.func.name}` needs {exc.name}: "
              f"pip install 'deepscope[{args.func.extra}]'", file=sys.stderr)
        return 2
    except (ValueError, TypeError, KeyError, DeepscopeError, OSError) as exc:
        # One line, no traceback: every deepscope error message names the fix.
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"deepscope: error: {clean(msg)}", file=sys.stderr)
        return 2
    finally:
        sys.stdout, sys.stderr = stdout, stderr


if __name__ == "__main__":
    sys.exit(main())
