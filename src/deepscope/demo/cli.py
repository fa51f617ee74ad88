"""`deepscope demo [PATH] [--steps N] [--no-serve] [--port P]`: the bug hunt, end to end."""

from __future__ import annotations

import argparse

from ..cli.verbs import verb
from .config import DEFAULT_PATH, DEFAULT_PORT, DemoConfig


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=DEFAULT_PATH,
                   help=f"project folder to record into (default: ./{DEFAULT_PATH})")
    p.add_argument("--steps", type=int, default=DemoConfig.steps,
                   help=f"training steps per run (default: {DemoConfig.steps})")
    p.add_argument("--no-serve", action="store_true",
                   help="only record; do not start the GUI afterwards")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port of the GUI on 127.0.0.1 (default: {DEFAULT_PORT})")


@verb("demo", "record the comgra tutorial's bug hunt (a bugged and a fixed run) and open it",
      _args)
def demo(args: argparse.Namespace) -> int:
    from ..cli.main import _size
    from .train import run_demo, serve_demo  # torch loads only for this verb

    result = run_demo(args.path, steps=args.steps)
    print(f"recorded {len(result['runs'])} runs into {result['path']} in "
          f"{result['seconds']:.0f} s, {_size(result['size_bytes'])} on disk"
          + ("" if result["instruments"] else " (without instruments: not available)"))
    for name in result["runs"]:
        print(f"  {name:<7} loss over the last 10% of steps {result['tail_loss'][name]:.3f}, "
              f"accuracy {result['tail_accuracy'][name]:.1%}")
    if args.no_serve:
        print(f"explore it with: deepscope serve {result['path']}")
    else:
        serve_demo(result["path"], args.port)
    return 0
