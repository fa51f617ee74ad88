"""The static instrument dashboard: Cockpit's layout as one matplotlib figure.

    +--------------------+----------------------+-------------------+
    | STEP SIZE          | GRADIENTS            | CURVATURE         |
    |  α gauge           |  gradient tests      |  max eigenvalue   |
    |  distance / update |  1-D histogram       |  trace            |
    |  gradient norm     |  2-D histogram       |  TIC              |
    +--------------------+----------------------+-------------------+
    | hyperparameters    | performance (loss, KPIs)                 |
    +--------------------+------------------------------------------+
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import matplotlib as mpl
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec

from .. import catalogue
from ..query import Run
from .data import DashboardData, open_for_plot
from .panels import (
    PRIMARY,
    SECONDARY,
    TERTIARY,
    draw_alpha,
    draw_gradient_tests,
    draw_hist1d,
    draw_hist2d,
    draw_series,
    message,
    panel_axes,
)

log = logging.getLogger("deepscope")

FIGSIZE = (18.0, 11.0)  # inches; 1800 × 1100 pixels at the default 100 dpi
STYLE = {"font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "legend.fontsize": 7,
         "xtick.labelsize": 7, "ytick.labelsize": 7}
LEARNING_RATE_KPIS = ("learning_rate", "lr")
NOT_PERFORMANCE = (*LEARNING_RATE_KPIS, "epoch_count")

Drawer = Callable[[Figure, SubplotSpec, DashboardData, bool], None]


def _series(key: str, title: str, right: tuple[str, ...] = (),
            layers_of: str | None = None) -> Drawer:
    """A panel of quantities over steps (the shared series helper in its own axes): those
    the catalogue puts in panel `key`, `right` ones on a right axis."""
    def draw(fig: Figure, cell: SubplotSpec, data: DashboardData, log_steps: bool) -> None:
        left = [q for q in catalogue.dashboard_quantities(key) if q not in right]
        draw_series(panel_axes(fig, cell, key, title), data, left, right, layers_of=layers_of,
                    log_steps=log_steps)
    return draw


def _alpha(fig: Figure, cell: SubplotSpec, data: DashboardData, log_steps: bool) -> None:
    draw_alpha(panel_axes(fig, cell, "alpha", "Alpha: step quality"), data)


def _tests(fig: Figure, cell: SubplotSpec, data: DashboardData, log_steps: bool) -> None:
    draw_gradient_tests(fig, cell, data, log_steps)


def _hist1d(fig: Figure, cell: SubplotSpec, data: DashboardData, log_steps: bool) -> None:
    draw_hist1d(panel_axes(fig, cell, "hist1d", "Gradient elements"), data)


def _hist2d(fig: Figure, cell: SubplotSpec, data: DashboardData, log_steps: bool) -> None:
    draw_hist2d(fig, cell, data)


def _hyperparameters(fig: Figure, cell: SubplotSpec, data: DashboardData,
                     log_steps: bool) -> None:
    logged = [n for n in LEARNING_RATE_KPIS if n in data.kpi_names()]
    draw_series(panel_axes(fig, cell, "hyperparameters", "Hyperparameters"), data,
                logged[:1] or ["learning_rate"], log_steps=log_steps,
                hint='pass scope.watch(model, optimizer=opt) or log rec.kpi("learning_rate", lr)')


def _performance(fig: Figure, cell: SubplotSpec, data: DashboardData, log_steps: bool) -> None:
    kpis = [n for n in data.kpi_names() if n not in NOT_PERFORMANCE]
    losses = [n for n in kpis if "loss" in n.lower()]
    # the "loss" KPI is logged on every step, the Loss quantity on instrumented ones only
    left = losses if "loss" in kpis else ["Loss", *losses]
    others = [n for n in kpis if n not in losses]
    draw_series(panel_axes(fig, cell, "performance", "Performance: loss (left), KPIs (right)"),
                data, left, others, log_steps=log_steps)


PANELS: dict[str, Drawer] = {
    "alpha": _alpha,
    "distance": _series("distance", "Distance from start (left), update size (right)",
                        ("UpdateSize",)),
    "gradnorm": _series("gradnorm", "Gradient norm"),
    "tests": _tests,
    "hist1d": _hist1d,
    "hist2d": _hist2d,
    "hessmaxev": _series("hessmaxev", "Hessian max eigenvalue"),
    "hesstrace": _series("hesstrace", "Hessian trace (grey: per layer)", layers_of="HessTrace"),
    "tic": _series("tic", "Takeuchi information criterion"),
    "hyperparameters": _hyperparameters,
    "performance": _performance,
}
GROUPS: tuple[tuple[str, str, tuple[str, str, str]], ...] = (
    ("STEP SIZE", PRIMARY, ("alpha", "distance", "gradnorm")),
    ("GRADIENTS", SECONDARY, ("tests", "hist1d", "hist2d")),
    ("CURVATURE", TERTIARY, ("hessmaxev", "hesstrace", "tic")),
)


def plot_dashboard(run_or_path: Run | str | Path, fig: Figure | None = None,
                   step: int | None = None, *, title: str | None = None,
                   log_steps: bool = False) -> Figure:
    """Draw Cockpit's instrument dashboard of a run into a matplotlib figure.

    Args:
        run_or_path: an open `Run`, or the path of a run folder (project/run).
        fig: a figure to redraw into (cleared first), e.g. in a training loop: call again
            with the same figure to update it; an interactive pyplot figure is refreshed
            at once. Default: a new standalone figure of 18 × 11 inches.
        step: show the run as it was at this step (default: everything so far).
        title: the figure title (default: run name and last step).
        log_steps: symmetric-log step axes (Cockpit's `show_log_iter`).

    Returns:
        The figure. Panels whose quantities the run lacks say "not tracked"; an empty run,
        NaN values or a single step draw without error.

    Raises:
        ValueError: `run_or_path` is not a run folder (one line naming the fix).
    """
    run, owned = open_for_plot(run_or_path)
    try:
        data = DashboardData.load(run, step)
    finally:
        if owned:
            run.close()
    if fig is None:
        fig = Figure(figsize=FIGSIZE)
    else:
        fig.clear()
    with mpl.rc_context(STYLE):
        _draw(fig, data, title, log_steps)
    _refresh(fig)
    return fig


def _draw(fig: Figure, data: DashboardData, title: str | None, log_steps: bool) -> None:
    outer = fig.add_gridspec(2, 3, height_ratios=[3, 1], left=0.04, right=0.97, top=0.93,
                             bottom=0.05, wspace=0.16, hspace=0.16)
    for column, (group, color, keys) in enumerate(GROUPS):
        cell = outer[0, column]
        background = fig.add_subplot(cell, label=f"group:{group}")
        background.set_facecolor((*mpl.colors.to_rgb(color), 0.25))
        background.set_title(group, fontweight="bold", fontsize=12)
        background.set_xticks([])
        background.set_yticks([])
        background.set_zorder(-1)
        inner = cell.subgridspec(5, 3, width_ratios=[0.1, 1, 0.05],
                                 height_ratios=[0.02, 1, 1, 1, 0.1], hspace=0.95)
        tracked = [k for k in keys if any(map(data.tracked, catalogue.dashboard_quantities(k)))]
        for row, key in enumerate(tracked):  # only what the run tracked, from the top
            _panel(fig, inner[row + 1, 1], key, data, log_steps)
        if not tracked:
            names = ", ".join(dict.fromkeys(
                q for k in keys for q in catalogue.dashboard_quantities(k)))
            message(background, f"not tracked in this run:\n{names}")
    _panel(fig, outer[1, 0], "hyperparameters", data, log_steps)
    _panel(fig, outer[1, 1:], "performance", data, log_steps)
    if title is None:
        title = f"deepscope cockpit: {data.name} ({_shown_steps(data)})"
    fig.suptitle(title, fontsize=14, fontweight="bold")


def _shown_steps(data: DashboardData) -> str:
    """The step the instrument panels show (that of the latest histograms too), and the last
    KPI step when KPIs go further (they are logged on every step)."""
    if data.last_step is None:
        return "no values yet"
    if data.last_quantity_step is None:
        return f"KPIs to step {data.last_step}"
    later = data.last_step > data.last_quantity_step
    return (f"instruments at step {data.last_quantity_step}"
            + (f", KPIs to step {data.last_step}" if later else ""))


def _panel(fig: Figure, cell: SubplotSpec, key: str, data: DashboardData,
           log_steps: bool) -> None:
    """Draw one panel; a failure is written into that panel, never raised (one broken
    panel must not cost a live dashboard the others)."""
    try:
        PANELS[key](fig, cell, data, log_steps)
    except Exception as error:  # noqa: BLE001
        log.warning("deepscope: dashboard panel %s failed: %s", key, error)
        ax = fig.add_subplot(cell, label=f"failed:{key}")
        ax.set_axis_off()
        message(ax, f"cannot draw {key}: {type(error).__name__}: {error}"[:160])


def _refresh(fig: Figure) -> None:
    """Let an interactive window show the redraw now (Cockpit's plt.pause in a loop)."""
    canvas = fig.canvas
    if (mpl.is_interactive() and canvas.manager is not None
            and getattr(canvas, "required_interactive_framework", None)):
        canvas.draw_idle()
        canvas.start_event_loop(0.001)
