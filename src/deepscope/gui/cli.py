"""`deepscope serve PATH [--host] [--port]` (registered when the CLI starts)."""

from __future__ import annotations

import argparse

from ..cli.verbs import verb


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a project folder (folder of runs) or one run folder")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8050, help="port (default 8050)")


@verb("serve", "serve the GUI for a project folder on http://127.0.0.1:8050 (open that "
      "address in your browser)", _serve_args, extra="gui")
def serve_cmd(args: argparse.Namespace) -> int:
    try:
        from .server import serve  # dash is an optional extra: import it only when used
    except ModuleNotFoundError as exc:
        raise ValueError(f"the GUI needs {exc.name}: pip install 'deepscope[gui]'") from None
    serve(args.path, args.host, args.port)
    return 0
