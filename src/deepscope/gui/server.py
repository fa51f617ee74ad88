"""Serve the GUI: `serve(path)` blocks; `make_server` gives a stoppable server (tests)."""

from __future__ import annotations

import ipaddress
import logging
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler
from werkzeug.serving import make_server as _make_wsgi_server

from .app import create_app
from .guard import describe

# The largest request body accepted: the GUI's own requests (a selection, a click) are a
# few kB; a larger body is refused before it is read (HTTP 413).
MAX_REQUEST_BYTES = 1 * 2**20
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
log = logging.getLogger("deepscope.gui")


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str) -> frozenset[str] | None:
    """Host-header names the server answers when bound to `host`; None: any.

    A page on another site can point its own domain name at 127.0.0.1 (DNS rebinding) and
    then read the GUI as "same origin"; its requests still carry its domain in the Host
    header, so a server bound to this machine answers only the names of this machine. A
    server bound to every address (0.0.0.0, ::) is reachable under names it cannot know.
    """
    name = host.strip("[]").lower()
    if name in ("0.0.0.0", "::", ""):
        return None
    return LOOPBACK_NAMES | {name} if is_loopback(name) else frozenset({name})


def _host_name(header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8050" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    """WSGI middleware: refuse requests for other host names (421) and request bodies over
    `max_body` bytes (413) before the app reads them."""

    def __init__(self, app: Callable[..., Iterable[bytes]], hosts: frozenset[str] | None,
                 max_body: int = MAX_REQUEST_BYTES) -> None:
        self.app, self.hosts, self.max_body = app, hosts, max_body

    def __call__(self, environ: dict[str, Any],
                 start_response: Callable[..., Any]) -> Iterable[bytes]:
        host = _host_name(environ.get("HTTP_HOST", ""))
        if self.hosts is not None and host not in self.hosts:
            return _refuse(start_response, "421 Misdirected Request",
                           "this deepscope server does not answer that host name")
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return _refuse(start_response, "400 Bad Request", "invalid Content-Length")
        if length > self.max_body:
            return _refuse(start_response, "413 Content Too Large",
                           f"request bodies are limited to {self.max_body} bytes")
        return self.app(environ, start_response)


def _refuse(start_response: Callable[..., Any], status: str, text: str) -> list[bytes]:
    body = text.encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                            ("Content-Length", str(len(body))), ("Connection", "close")])
    return [body]


class _QuietHandler(WSGIRequestHandler):
    """No line per request: the GUI polls, and the terminal belongs to the user. Malformed
    requests are one line each, never a traceback."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass

    def log_error(self, format: str, *args: Any) -> None:
        text = (format % args).splitlines()
        log.warning("deepscope gui: bad request from %s: %s", self.address_string(),
                    "".join(c if c.isprintable() else "?" for c in (text[0] if text else ""))
                    [:200])


def _log_one_line(exc_info: Any) -> None:
    """Flask's log of an exception the app did not handle (a malformed request that reached
    Dash): one line, not the traceback."""
    log.warning("deepscope gui: request failed: %s", describe(exc_info[1]))


def make_server(project_path: str | Path, host: str = "127.0.0.1",
                port: int = 8050) -> BaseWSGIServer:
    """A threaded HTTP server for the app (port 0: any free port, see `.server_port`)."""
    app = create_app(project_path)
    flask = app.server
    flask.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES  # bodies sent without a length
    flask.log_exception = _log_one_line  # type: ignore[method-assign]
    return _make_wsgi_server(host, port, RequestGuard(flask, allowed_hosts(host)),
                             threaded=True, request_handler=_QuietHandler)


def serve(project_path: str | Path, host: str = "127.0.0.1", port: int = 8050) -> None:
    """Serve the GUI until interrupted. Binds 127.0.0.1 unless told otherwise."""
    if not is_loopback(host):
        print(f"deepscope: warning: serving on {host}: anyone who can reach this machine on "
              "that network can read the runs (tensor values, notes); use the default "
              "127.0.0.1 unless you mean it", file=sys.stderr)
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
