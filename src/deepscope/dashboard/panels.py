"""Drawing helpers, one per panel kind: series over steps, the α gauge, the gradient-test
gauge, and the 1-D and 2-D gradient histograms.

Every helper draws whatever `DashboardData` has and writes the panel's state into the
panel itself when there is nothing to draw ("not tracked", "no value yet"), so one
missing quantity never costs the rest of the figure. Missing or non-finite values are
never dropped silently: series mark their steps with red crosses on the step axis and
histograms list their out-of-range and non-finite counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec

from ..ranges import log_fits, shared_range
from .data import DashboardData, Series

# Cockpit's palette, so the layout reads the same to its users
PRIMARY, SECONDARY, TERTIARY = "#4a73ad", "#f28033", "#339966"
LINE_COLORS = (PRIMARY, SECONDARY, TERTIARY, "#8e6bb8", "#c44e52", "#6f6f6f")
MISSING = "#d62728"
GUIDE = "#ababba"
ALPHA_VIEW = 1.5  # the α gauge shows [-1.5, 1.5]; values beyond are counted, not hidden
FEW_POINTS = 30  # series this short get markers, so a single step is still visible
EXTRAS = (("underflow", "below range"), ("overflow", "above range"), ("nan", "NaN"),
          ("posinf", "+Inf"), ("neginf", "-Inf"), ("param_underflow", "θ below range"),
          ("param_overflow", "θ above range"), ("param_nonfinite", "θ non-finite"))
NON_FINITE = {"nan", "posinf", "neginf", "param_nonfinite"}


def panel_axes(fig: Figure, cell: SubplotSpec, key: str, title: str) -> Axes:
    """The main axes of panel `key`, labelled "panel:<key>" so it can be found again."""
    ax = fig.add_subplot(cell)
    ax.set_label(f"panel:{key}")
    ax.set_title(title, fontweight="bold")
    return ax


def message(ax: Axes, text: str) -> None:
    """Write a panel's state across it (used when there is nothing, or nothing finite)."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="dimgray",
            fontsize=9, wrap=True)


def absent_text(data: DashboardData, names: Sequence[str]) -> str:
    """Why a panel whose quantities have no stored value is empty."""
    if any(data.tracked(n) for n in names):
        return "tracked, no value yet"
    return "not tracked"


def _blank(ax: Axes, text: str) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    message(ax, text)


# -- series over steps --------------------------------------------------------------------
def draw_series(ax: Axes, data: DashboardData, left: Sequence[str], right: Sequence[str] = (),
                *, layers_of: str | None = None, log_steps: bool = False,
                hint: str = "") -> None:
    """Quantities / KPIs over steps: `left` on the left axis, `right` on a twin axis.

    layers_of: also draw that quantity's per-layer values, thin and faint, behind.
    log_steps: a symmetric-log step axis (Cockpit's show_log_iter).
    hint: a line added to "not tracked", saying how to track it.
    """
    names = [*left, *right]
    found = {n: data.series(n) for n in names}
    if all(s is None for s in found.values()):
        _blank(ax, absent_text(data, names) + (f"\n{hint}" if hint else ""))
        return
    twin = ax.twinx() if any(found[n] is not None for n in right) else None
    if layers_of is not None:
        for layer in data.layers(layers_of):
            s = data.series(layers_of, layer)
            if s is not None:
                ax.plot(s.steps, s.values, color=GUIDE, lw=0.8, alpha=0.7, zorder=1)
    drawn, on = [], {ax: [], twin: []}
    for index, name in enumerate(names):
        s = found[name]
        if s is None:
            continue
        target = twin if (twin is not None and name in right) else ax
        drawn.append(_line(target, s, LINE_COLORS[index % len(LINE_COLORS)]))
        on[target].append((s, LINE_COLORS[index % len(LINE_COLORS)]))
    outside = sum(fit_values(axis, shown) for axis, shown in on.items() if axis and shown)
    if log_steps:
        ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("step")
    handles = [h for axis in (ax, twin) if axis is not None
               for h in axis.get_legend_handles_labels()[0]]
    # in the headroom `fit_values` left above the values: the legend covers no point
    ax.legend(handles=handles, loc="upper left", ncol=min(len(handles), 3), framealpha=0.7,
              borderaxespad=0.2)
    if outside:
        ax.text(0.99, 0.99, f"▲▼ {outside} outside", transform=ax.transAxes, ha="right",
                va="top", fontsize=6, color="dimgray")
    if not any(s.finite.any() for s in drawn):
        reasons = [s.reason for s in drawn if s.reason]
        message(ax, "no finite value" + (f"\n{reasons[-1][:80]}" if reasons else ""))


def fit_values(ax: Axes, shown: Sequence[tuple[Series, str]], headroom: float = 0.3) -> int:
    """Fit `ax`'s value range to the bulk of the series' points (log scale when positive
    over more than two decades), mark points beyond it at the edge (▲ ▼), and leave
    `headroom` of the range free at the top for the legend. Returns how many points lie
    outside."""
    values = np.concatenate([s.values for s, _ in shown])
    log = log_fits(values)
    bulk = shared_range([s.values for s, _ in shown], log)
    if bulk is None:
        return 0
    if log:
        ax.set_yscale("log")
    lo, hi = bulk
    span = hi - lo if hi > lo else (1.0 if log else 0.1 * abs(hi) or 1.0)
    low, high = lo - 0.05 * span, hi + (0.05 + headroom) * span
    ax.set_ylim(*((10 ** low, 10 ** high) if log else (low, high)))
    lo, hi = (10 ** lo, 10 ** hi) if log else (lo, hi)
    outside = 0
    for s, color in shown:
        for beyond, edge, marker in ((s.values > hi, hi, "^"), (s.values < lo, lo, "v")):
            beyond &= s.finite
            if beyond.any():
                ax.plot(s.steps[beyond], np.full(int(beyond.sum()), edge), ls="none",
                        marker=marker, color=color, mec="#333", ms=5, clip_on=False, zorder=4)
                outside += int(beyond.sum())
    return outside


def _line(ax: Axes, s: Series, color: str) -> Series:
    """One series: its finite values as a line, its missing steps as red crosses."""
    ok = s.finite
    last = s.last()
    label = s.name if last is None else f"{s.name}: {last:.3g}"
    if (~ok).any():
        label += f" ({int((~ok).sum())} missing)"
    if s.every > 1:  # its sparser points are a cadence, not gaps
        label += f" (every {s.every} instrumented steps)"
    if s.noted is not None:
        label += f" ({int(s.noted.sum())} noted: rings)"
    marker = "o" if ok.sum() <= FEW_POINTS else None
    # NaN breaks the line: a gap shows where values are missing
    ax.plot(s.steps, s.values, color=color, marker=marker, ms=3, lw=1.5, label=label, zorder=2)
    if s.noted is not None:  # values stored with a note, e.g. a lower bound: not like the rest
        ax.plot(s.steps[s.noted], s.values[s.noted], ls="none", marker="o", ms=7, mfc="white",
                mec=color, zorder=3)
    if (~ok).any():
        ax.plot(s.steps[~ok], np.zeros(int((~ok).sum())), ls="none", marker="x", color=MISSING,
                transform=ax.get_xaxis_transform(), clip_on=False, zorder=3)
    return s


# -- α gauge ---------------------------------------------------------------------------
def draw_alpha(ax: Axes, data: DashboardData) -> None:
    """α's distribution over the normalised parabola, with the last step marked on it.

    Why the unit parabola is the fit: with s ↦ x = s / s_min − 1 (s_min the fitted
    minimum along the step) and the loss scaled so that the start is at height 1 and the
    valley floor at 0, every fitted parabola becomes y = x²; the step starts at x = −1 and
    ends at x = α. So the sketch is exact for every step, and the histogram on the twin
    axis shows where the steps land.
    """
    s = data.series("Alpha")
    if s is None:
        _blank(ax, absent_text(data, ["Alpha"]))
        return
    x = np.linspace(-ALPHA_VIEW, ALPHA_VIEW, 121)
    ax.plot(x, x**2, color=SECONDARY, lw=2, label="fitted parabola (normalised)")
    for guide in (-1.0, 0.0, 1.0):
        ax.axvline(guide, color=GUIDE, lw=1, zorder=0)
    ax.set_xlim(-ALPHA_VIEW, ALPHA_VIEW)
    ax.set_ylim(0, (ALPHA_VIEW**2 + 0.1) * 1.45)  # headroom for the legend
    ax.set_xlabel("α (normalised step length)")
    ax.set_ylabel("normalised loss")
    values = s.values[s.finite]
    missing = int((~s.finite).sum())
    if values.size == 0:
        message(ax, "no finite α" + (f"\n{s.reason[:80]}" if s.reason else ""))
        return
    # beyond the view, values sit in the edge bins and are counted in the note below
    shown = np.clip(values, -ALPHA_VIEW, ALPHA_VIEW)
    recent = shown[-max(1, len(shown) // 10):]
    bins = np.linspace(-ALPHA_VIEW, ALPHA_VIEW, 31)
    density = ax.twinx()
    density.hist(shown, bins, color="gray", alpha=0.5, label=f"all (μ={values.mean():.2f})")
    density.hist(recent, bins, color=PRIMARY, alpha=0.85,
                 label=f"last 10% (μ={values[-len(recent):].mean():.2f})")
    density.set_ylabel("steps")
    density.set_ylim(0, density.get_ylim()[1] * 1.45)
    end = float(shown[-1])
    ax.plot([-1.0, end], [1.0, end**2], ls="none", marker="o", color=PRIMARY, ms=6, zorder=4,
            label=f"last step: α = {values[-1]:.2f}")
    notes = []
    outside = int((np.abs(values) > ALPHA_VIEW).sum())
    if outside:
        notes.append(f"{outside} outside ±{ALPHA_VIEW}")
    if missing:
        notes.append(f"{missing} missing")
    if notes:  # in the title: the legend fills the top of the panel
        ax.set_title(f"{ax.get_title()} ({', '.join(notes)})", fontweight="bold",
                     color=MISSING)
    handles = ax.get_legend_handles_labels()[0] + density.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper center", ncol=2, framealpha=0.7)


# -- gradient tests ---------------------------------------------------------------------
TESTS = ("NormTest", "InnerTest", "OrthoTest")


def draw_gradient_tests(fig: Figure, cell: SubplotSpec, data: DashboardData,
                        log_steps: bool = False) -> None:
    """Cockpit's gradient-test gauge: the norm test as a disc, the inner-product test as
    a horizontal band, the orthogonality test as a vertical band (latest values), with
    the three tests over steps beside it."""
    grid = cell.subgridspec(3, 2, width_ratios=[1.2, 1], wspace=0.3, hspace=0.12)
    gauge = panel_axes(fig, grid[:, 0], "tests", "Gradient tests")
    found = {n: data.series(n) for n in TESTS}
    if all(s is None for s in found.values()):
        _blank(gauge, absent_text(data, TESTS))
        return
    gauge.set_xscale("symlog", linthresh=0.1)
    gauge.set_yscale("symlog", linthresh=0.1)
    gauge.set_xlim(-2, 2)
    gauge.set_ylim(-2, 2)
    gauge.grid(ls="--", lw=0.5)
    gauge.plot(0, 0, marker="+", color="black", ms=14, mew=3)
    last = {n: (s.last() if s is not None else None) for n, s in found.items()}
    if last["NormTest"] is not None:
        # a polygon, not a Circle patch: it stays round under the symlog axes
        t = np.linspace(0, 2 * np.pi, 200)
        r = last["NormTest"]
        gauge.fill(r * np.cos(t), r * np.sin(t), color=PRIMARY, alpha=0.4,
                   label=f"norm {r:.3g}")
    if last["InnerTest"] is not None:
        w = last["InnerTest"]
        gauge.axhspan(-w, w, color=SECONDARY, alpha=0.4, label=f"inner {w:.3g}")
    if last["OrthoTest"] is not None:
        w = last["OrthoTest"]
        gauge.axvspan(-w, w, color=TERTIARY, alpha=0.4, label=f"ortho {w:.3g}")
    gauge.legend(loc="lower left", framealpha=0.7)
    for row, name in enumerate(TESTS):
        draw_series(fig.add_subplot(grid[row, 1]), data, [name], log_steps=log_steps)


# -- histograms -------------------------------------------------------------------------
def _extras_note(ax: Axes, meta: dict) -> None:
    """List what the bins do not show: out-of-range and non-finite counts."""
    parts = [(key, f"{label} {int(meta[key])}") for key, label in EXTRAS if meta.get(key)]
    if parts:
        alarm = any(key in NON_FINITE for key, _ in parts)
        ax.text(0.99, 0.97, ", ".join(text for _, text in parts), transform=ax.transAxes,
                ha="right", va="top", fontsize=7, color=MISSING if alarm else "dimgray")


def draw_hist1d(ax: Axes, data: DashboardData) -> None:
    """The latest histogram of per-sample gradient elements (symmetric-log counts)."""
    hist = data.histogram("GradHist1d")
    if hist is None:
        _blank(ax, absent_text(data, ["GradHist1d"]))
        return
    ax.set_title(f"Gradient elements (step {hist.step})", fontweight="bold")
    ax.stairs(hist.counts, hist.edges[0], fill=True, color=PRIMARY, alpha=0.85)
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xlabel("per-sample gradient element")
    ax.set_ylabel("count")
    _extras_note(ax, hist.meta)


def draw_hist2d(fig: Figure, cell: SubplotSpec, data: DashboardData) -> None:
    """The latest parameter × gradient-element histogram with both marginals."""
    grid = cell.subgridspec(2, 2, width_ratios=[4, 1], height_ratios=[1, 3], wspace=0.04,
                            hspace=0.06)
    main = panel_axes(fig, grid[1, 0], "hist2d", "")
    top = fig.add_subplot(grid[0, 0], sharex=main)
    side = fig.add_subplot(grid[1, 1], sharey=main)
    hist = data.histogram("GradHist2d")
    title = "Parameters × gradient elements"
    top.set_title(title if hist is None else f"{title} (step {hist.step})", fontweight="bold")
    for marginal in (top, side):
        marginal.tick_params(labelbottom=False, labelleft=False)
    if hist is None:
        for marginal in (top, side):
            marginal.set_axis_off()
        _blank(main, absent_text(data, ["GradHist2d"]))
        return
    param_edges, grad_edges = hist.edges
    counts = np.asarray(hist.counts, dtype=np.float64)  # (param bins, grad bins)
    main.imshow(np.log1p(counts), origin="lower", aspect="auto", cmap="viridis",
                extent=(grad_edges[0], grad_edges[-1], param_edges[0], param_edges[-1]))
    main.set_xlabel("per-sample gradient element")
    main.set_ylabel("parameter θ")
    top.stairs(counts.sum(0), grad_edges, fill=True, color=PRIMARY)
    top.set_yscale("symlog", linthresh=1)
    side.stairs(counts.sum(1), param_edges, fill=True, color=PRIMARY, orientation="horizontal")
    side.set_xscale("symlog", linthresh=1)
    _extras_note(main, hist.meta)
