"""What the GUI server answers: only this machine's host names, bounded request bodies, and
one log line per malformed request.

A page on another site can point its own domain name at 127.0.0.1 (DNS rebinding) and then
read the GUI as "same origin"; its requests still carry its domain in the Host header, so a
server bound to this machine answers only the names of this machine (HTTP 421 otherwise).
Request bodies over MAX_REQUEST_BYTES are refused before they are read (HTTP 413).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from flask import Flask

from .guard import describe

# The GUI's own requests (a selection, a click) are a few kB.
MAX_REQUEST_BYTES = 1 * 2**20
log = logging.getLogger("deepscope.gui")


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


def guarded(app: Flask, hosts: frozenset[str] | None) -> RequestGuard:
    """`app` behind a RequestGuard answering `hosts` (None: any); bodies sent without a
    length are capped by Flask, and an exception the app did not handle (a malformed request
    that reached Dash) is logged as one line, not a traceback."""
    app.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES
    app.log_exception = _log_one_line  # type: ignore[method-assign]
    return RequestGuard(app, hosts)


def _log_one_line(exc_info: Any) -> None:
    log.warning("deepscope gui: request failed: %s", describe(exc_info[1]))


def log_bad_request(client: str, text: str) -> None:
    """One printable line for a request the HTTP server could not parse."""
    first = text.splitlines()[0] if text else ""
    log.warning("deepscope gui: bad request from %s: %s", client,
                "".join(c if c.isprintable() else "?" for c in first)[:200])
