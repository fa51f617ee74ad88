"""Statistics of the global batch from the ranks' records, combined exactly.

A record's statistics are sufficient to combine: with f = numel − nan − posinf − neginf the
finite elements a rank's mean / std / abs_mean are over, the merged mean is Σ f·mean / Σ f,
the merged M2 = Σ f·(std² + (mean − merged mean)²) (Chan et al.'s pairwise update), min / max
/ abs_max the extremes, norm = √Σ norm², zero_frac weighted by numel (it is over all
elements), counts summed. sv_max has no such decomposition: NaN.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..store.schema import STAT_COLUMNS

KEYS = ["step", "iteration", "tensor", "direction"]


def merge(frames: pd.DataFrame, batch_tensors: set[str], expected: int
          ) -> tuple[pd.DataFrame, list[str], list[str]]:
    """One row per record of the global batch from `frames` (stats_wide rows with a `rank`
    column, sorted by rank).

    Records of `batch_tensors` (those with a batch dimension) are combined over the ranks and
    need one row from each of the `expected` ranks, else their statistics are NaN. Other
    records (parameters and their gradients, the same on every rank after DDP's sync) are the
    lowest rank's row. Returns (rows in `KEYS` order of appearance, tensors whose batch
    records lack a rank, tensors whose unbatched records differ between ranks).
    """
    batched = frames["tensor"].isin(batch_tensors)
    one, incomplete = _combine(frames[batched], expected)
    rest = frames[~batched]
    stats = list(STAT_COLUMNS)
    differs = rest.groupby(KEYS, sort=False)[stats].nunique(dropna=False).gt(1).any(axis=1)
    differing = sorted({key[2] for key in differs[differs].index})
    first = rest.drop_duplicates(KEYS, keep="first").drop(columns="rank")
    return pd.concat([one, first], ignore_index=True), incomplete, differing


def _combine(rows: pd.DataFrame, expected: int) -> tuple[pd.DataFrame, list[str]]:
    cols = KEYS + list(STAT_COLUMNS)
    if rows.empty:
        return rows[cols].copy(), []
    f = (rows["numel"] - rows["nan"] - rows["posinf"] - rows["neginf"]).to_numpy()
    has = f > 0  # a rank without finite elements has NaN moments: it adds no weight
    w = pd.DataFrame({
        "f": f, "fm": np.where(has, f * rows["mean"], 0.0),
        "fa": np.where(has, f * rows["abs_mean"], 0.0),
        "sq": rows["norm"].to_numpy() ** 2,
        "zeros": rows["zero_frac"].to_numpy() * rows["numel"].to_numpy()}, index=rows.index)
    keys = [rows[k] for k in KEYS]
    group = w.groupby(keys, sort=False)
    mean_all = (group["fm"].transform("sum") / group["f"].transform("sum")).to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        w["m2"] = np.where(has, f * (rows["std"].to_numpy() ** 2
                                     + (rows["mean"].to_numpy() - mean_all) ** 2), 0.0)
    sums = w.groupby(keys, sort=False).sum()
    ext = rows.groupby(KEYS, sort=False)
    counts = ext[["numel", "nan", "posinf", "neginf"]].sum()
    n_ranks = ext["rank"].nunique()
    out = pd.DataFrame(index=sums.index)
    with np.errstate(invalid="ignore", divide="ignore"):
        out["numel"] = counts["numel"]
        out["mean"] = sums["fm"] / sums["f"]
        out["std"] = np.sqrt(sums["m2"] / sums["f"])
        out["abs_mean"] = sums["fa"] / sums["f"]
        out["min"] = ext["min"].min()
        out["max"] = ext["max"].max()
        out["abs_max"] = ext["abs_max"].max()
        out["norm"] = np.sqrt(sums["sq"])
        out["zero_frac"] = sums["zeros"] / counts["numel"].clip(lower=1.0)
    for c in ("nan", "posinf", "neginf"):
        out[c] = counts[c]
    out["sv_max"] = np.nan
    short = n_ranks < expected
    out.loc[short.to_numpy(), list(STAT_COLUMNS)] = np.nan  # part of the global batch only
    incomplete = sorted({key[2] for key in short[short].index})
    return out.reset_index()[cols], incomplete
