"""`deepscope` — ls, serve, demo, plot, export, doctor. Each verb is a thin layer over the API."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import DeepscopeError
from ..query import Project, Run
from ..store.layout import is_run_dir
from .text import SafeStream, clean

Verb = Callable[[argparse.Namespace], int]
VERBS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Verb]] = {}


def verb(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None]
         ) -> Callable[[Verb], Verb]:
    """Register a sub-command; feature modules add theirs the same way."""
    def register(fn: Verb) -> Verb:
        VERBS[name] = (help, configure, fn)
        return fn
    return register


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


def _load_verbs() -> None:
    """Import the modules that register the other verbs (optional extras may be missing)."""
    import importlib
    for module in ("deepscope.gui.cli", "deepscope.demo.cli", "deepscope.dashboard.cli",
                   "deepscope.export.cli", "deepscope.anomalies.cli"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("deepscope"):
                raise


def build_parser() -> argparse.ArgumentParser:
    _load_verbs()
    parser = argparse.ArgumentParser(
        prog="deepscope", description="See inside a PyTorch network while it trains.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for name, (help_text, configure, fn) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Everything a verb prints passes through `clean`: names and texts come from run files.
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = SafeStream(stdout), SafeStream(stderr)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, KeyError, DeepscopeError, OSError) as exc:
        # One line, no traceback: every deepscope error message names the fix.
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"deepscope: error: {clean(msg)}", file=sys.stderr)
        return 2
    finally:
        sys.stdout, sys.stderr = stdout, stderr


if __name__ == "__main__":
    sys.exit(main())
