"""A run as TensorBoard event files: KPIs, scalar quantities, tensor statistics, histograms."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import catalogue
from ..query.run import Run

# Tensor statistics exported as scalars (all of them would swamp TensorBoard's scalar page).
EXPORTED_STATS = ("mean", "std", "abs_max", "norm", "nan", "posinf", "neginf")


def export_tensorboard(run: Run, log_dir: str | Path) -> Path:
    """Write `run` into `log_dir/<run name>` as TensorBoard events; returns that folder.

    Tags: kpi/<name>, quantity/<name>[/<layer>], <tensor>/<direction>/<statistic>, and
    histograms hist/<name>[/<layer>] for the catalogue's 1-D histograms (GradHist1d; raw
    bins; out-of-range and non-finite counts are exported as scalars beside them, as
    TensorBoard cannot show them).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ModuleNotFoundError:
        raise ValueError("TensorBoard export needs tensorboard: pip install "
                         "'deepscope[export]'") from None
    target = Path(log_dir) / run.name
    writer = SummaryWriter(str(target))
    try:
        for row in run.kpis().itertuples():
            writer.add_scalar(f"kpi/{row.name}", row.value, row.step)
        quantities = run.quantities()
        for row in quantities.itertuples():
            tag = f"quantity/{row.name}" + (f"/{row.layer}" if row.layer else "")
            if not np.isnan(row.value):
                writer.add_scalar(tag, row.value, row.step)
        stats = run.stats_wide()
        for row in stats.itertuples():
            for stat in EXPORTED_STATS:
                value = getattr(row, stat)
                if not np.isnan(value):
                    writer.add_scalar(f"{row.tensor}/{row.direction}/{stat}", value, row.step)
        hists = quantities[quantities["name"].isin(catalogue.histograms(dims=1))]
        for row in hists.itertuples():
            _add_histogram(writer, run, row.name, row.layer, row.step)
    finally:
        writer.close()
    return target


def _add_histogram(writer, run: Run, name: str, layer: str, step: int) -> None:
    """One stored GradHist1d as a TensorBoard histogram; one recorded as missing (its reason
    is in the run) is left out, as its NaN scalar is."""
    hist = run.histogram(name, step, layer, missing_ok=True)
    if hist.missing:
        return
    counts, (edges,) = hist.counts, hist.edges
    centres = (edges[:-1] + edges[1:]) / 2
    total = float(counts.sum())
    tag = f"hist/{name}" + (f"/{layer}" if layer else "")
    if total > 0:
        writer.add_histogram_raw(
            tag, min=float(edges[0]), max=float(edges[-1]), num=total,
            sum=float((counts * centres).sum()), sum_squares=float((counts * centres**2).sum()),
            bucket_limits=edges[1:].tolist(), bucket_counts=counts.astype(float).tolist(),
            global_step=step)
    for extra, count in hist.extras.items():
        writer.add_scalar(f"{tag}/{extra}", float(count), step)
