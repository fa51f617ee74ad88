"""`CockpitPlotter`: Cockpit's plotting call, drawn by deepscope's static dashboard."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ...dashboard import plot_dashboard
from ...dashboard.figure import FIGSIZE
from .cockpit import Cockpit


class CockpitPlotter:
    """Draws a Cockpit (or a deepscope run folder) as Cockpit's dashboard, redrawing the
    same figure on every call, as Cockpit does in a training loop."""

    def __init__(self, secondary_screen: bool = False) -> None:
        if secondary_screen:
            warnings.warn("deepscope: the secondary screen is not drawn; MeanGSNR, CABS and "
                          "EarlyStopping are in the GUI's Instruments tab", stacklevel=2)
        self.fig: Figure | None = None

    def plot(self, source: Cockpit | str | Path, savedir: str | Path | None = None,
             show_plot: bool = True, save_plot: bool = False, savename: str = "cockpit",
             savename_append: str | None = None, block: bool = False,
             show_log_iter: bool = False, discard: int | None = None,
             plot_title: str | None = None, debug: bool = False,
             savefig_kwargs: dict[str, Any] | None = None) -> None:
        """Draw the dashboard of `source` as it is now.

        Args:
            source: a `Cockpit`, or the path of a deepscope run folder (e.g. its run_path).
            savedir: with save_plot, the folder (created if missing) the image goes to, as
                `savedir/<savename>__primary[__<savename_append>].png` (Cockpit's naming).
                Required for a Cockpit source; for a run folder it defaults to that folder.
            savename: the file name's start (default "cockpit").
            savefig_kwargs: passed to `Figure.savefig`, e.g. {"dpi": 50}.
            show_plot: show in a window when matplotlib has an interactive backend.
            block: wait until the window is closed.
            show_log_iter: symmetric-log step axes.
            discard: show only steps up to this one.
            plot_title: the figure title.
            debug: accepted for compatibility.

        Raises:
            ValueError: save_plot for a Cockpit without savedir, or a path that is not a run.
        """
        if isinstance(source, Cockpit):
            source.flush()
            run_path: Any = source.run_path
        else:
            run_path = source
        if self.fig is None:
            # a pyplot figure only when it may be shown: standalone figures are not tracked
            # by pyplot, so saving-only use leaks nothing
            self.fig = plt.figure("deepscope cockpit", figsize=FIGSIZE) if show_plot else \
                Figure(figsize=FIGSIZE)
        plot_dashboard(run_path, fig=self.fig, step=discard, title=plot_title,
                       log_steps=show_log_iter)
        if show_plot and getattr(self.fig.canvas, "required_interactive_framework", None):
            plt.show(block=block)
            if not block:
                plt.pause(0.001)
        if save_plot:
            if savedir is None:
                if isinstance(source, Cockpit):
                    raise ValueError("Please specify savedir when plotting a Cockpit.")
                savedir = source
            append = "" if savename_append is None else f"__{savename_append}"
            os.makedirs(savedir, exist_ok=True)
            self.fig.savefig(os.path.join(savedir, f"{savename}__primary{append}.png"),
                             **(savefig_kwargs or {}))
