"""The web GUI: graph explorer, instruments dashboard, KPIs, run comparison, live updates.

`create_app(path)` builds the Dash app; `serve(path)` runs it (`deepscope serve PATH`).
Dash is imported only when one of them is used, so the CLI starts fast without the extra.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app
        return create_app
    if name == "serve":
        from .server import serve
        return serve
    raise AttributeError(f"module 'deepscope.gui' has no attribute {name!r}")
