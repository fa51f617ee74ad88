"""Keep a failure inside the panel it happened in.

A callback that raises would leave its panel stale and show Dash's error overlay; instead the
panel itself says what went wrong (one line) and the rest of the page keeps working.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from dash import html
from dash.exceptions import PreventUpdate

from ..errors import DeepscopeError
from .figures import message_figure

log = logging.getLogger("deepscope.gui")
T = TypeVar("T")


def describe(exc: Exception) -> str:
    """One line: the exception's type and message."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return f"{type(exc).__name__}: {text}"[:300]


def contained(make: Callable[[], T], on_error: Callable[[str], T], what: str) -> T:
    """`make()`, or `on_error(message)` if it raises (logged in full for the terminal)."""
    try:
        return make()
    except PreventUpdate:
        raise
    except Exception as exc:  # shown in the panel, logged for the terminal
        report(what, exc)
        return on_error(describe(exc))


def report(what: str, exc: Exception) -> None:
    """Log a failure: one line for deepscope's own errors (a damaged file, a bad path), the
    traceback for anything unexpected."""
    log.warning("deepscope gui: %s failed: %s", what, describe(exc),
                exc_info=not isinstance(exc, DeepscopeError))


def guard(on_error: Callable[[str], Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a callback: an exception becomes `on_error(message)` for its outputs."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return contained(lambda: fn(*args, **kwargs), on_error, fn.__name__)
        return wrapper
    return decorate


def error_figure(message: str, title: str = "", height: int = 260) -> dict[str, Any]:
    """The panel-level error shown instead of a chart."""
    return message_figure(f"could not draw this panel — {message}", title, height=height)


def figure_guard(title: str, height: int = 260) -> Callable[[Callable[..., Any]],
                                                            Callable[..., Any]]:
    """For a callback whose one output is a figure."""
    return guard(lambda msg: error_figure(msg, title, height))


def error_box(message: str) -> html.Div:
    """The panel-level error shown instead of a table or list."""
    return html.Div(f"could not show this panel — {message}", className="panel-error",
                    role="alert")
