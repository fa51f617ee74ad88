"""Serve the GUI: `serve(path)` blocks; `make_server` gives a stoppable server (tests)."""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
from pathlib import Path

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler
from werkzeug.serving import make_server as _make_wsgi_server

from ..query import Project
from .app import create_app
from .http_guard import guarded, log_bad_request

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str) -> frozenset[str] | None:
    """Host-header names a server bound to `host` answers (see `http_guard`); None: any,
    for a server bound to every address (0.0.0.0, ::), reachable under names it cannot know.
    """
    name = host.strip("[]").lower()
    if name in ("0.0.0.0", "::", ""):
        return None
    return LOOPBACK_NAMES | {name} if is_loopback(name) else frozenset({name})


class _QuietHandler(WSGIRequestHandler):
    """No line per request: the GUI polls, and the terminal belongs to the user."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass

    def log_error(self, format: str, *args: object) -> None:
        log_bad_request(self.address_string(), format % args)  # one line, never a traceback


def make_server(project_path: str | Path, host: str = "127.0.0.1",
                port: int = 8050) -> BaseWSGIServer:
    """A threaded HTTP server for the app (port 0: any free port, see `.server_port`)."""
    app = create_app(project_path)
    wsgi = guarded(app.server, allowed_hosts(host))
    return _make_wsgi_server(host, port, wsgi, threaded=True,
                             request_handler=_QuietHandler)


def _check_port_free(host: str, port: int) -> None:
    """One-line OSError naming --port if `port` is taken (werkzeug would print several lines
    and exit the process instead)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise OSError(f"port {port} on {host} is already in use (another deepscope "
                          f"serve?); choose another with --port, e.g. --port {port + 1}") \
                from None


def serve(project_path: str | Path, host: str = "127.0.0.1", port: int = 8050) -> None:
    """Serve the GUI until interrupted. Binds 127.0.0.1 unless told otherwise.

    A missing folder or a port in use is a one-line error before anything is served.
    """
    Project(project_path)  # the folder must exist (it may still be empty: runs appear)
    if not is_loopback(host):
        print(f"deepscope: warning: serving on {host}: anyone who can reach this machine on "
              "that network can read the runs (tensor values, notes); use the default "
              "127.0.0.1 unless you mean it", file=sys.stderr)
    _check_port_free(host, port)
    server = make_server(project_path, host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"deepscope: serving {Path(project_path).resolve()} on "
          f"http://{shown}:{server.server_port}/ (Ctrl+C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
