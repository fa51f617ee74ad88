"""Static instrument dashboard: Cockpit's layout as one matplotlib figure, from any run.

    from deepscope.dashboard import plot_dashboard
    fig = plot_dashboard("runs/baseline")
    fig.savefig("cockpit.png")

From the shell: `deepscope plot runs/baseline -o cockpit.png`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["plot_dashboard"]


def __getattr__(name: str) -> Any:
    # matplotlib loads on first use, not when the CLI registers `deepscope plot`
    if name == "plot_dashboard":
        from .figure import plot_dashboard

        return plot_dashboard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
